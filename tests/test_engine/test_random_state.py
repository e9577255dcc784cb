"""torch's generator state in a checkpoint (engine/checkpoint/random_state.py):
put back at the iteration it was saved after, refused with a reason (and
nothing changed) where this process could not have written it."""
import types

import pytest
import torch

from mmseg_gf.engine.checkpoint import random_state


def _runner(iteration):
    return types.SimpleNamespace(iter=iteration)


def test_the_state_comes_back_at_the_iteration_it_was_saved_after():
    checkpoint = {'meta': {'iter': 4}}
    torch.manual_seed(0)
    random_state.ResumedRandomState.save(checkpoint)
    want = torch.rand(3)
    resumed = random_state.ResumedRandomState()
    resumed.loaded(checkpoint)
    torch.rand(5)  # what building the model draws
    resumed.before_iteration(_runner(4))
    assert torch.equal(torch.rand(3), want)


def test_a_checkpoint_loaded_at_another_iteration_restores_nothing():
    """``load_from`` of another run's checkpoint starts at iteration 0."""
    checkpoint = {'meta': {'iter': 4}}
    random_state.ResumedRandomState.save(checkpoint)
    resumed = random_state.ResumedRandomState()
    resumed.loaded(checkpoint)
    before = torch.get_rng_state()
    resumed.before_iteration(_runner(0))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize('state,reason', [
    ('not a state', 'not a torch generator state'),
    ({'torch': torch.zeros(7, dtype=torch.uint8)},
     'not a torch generator state'),
    ({'torch': torch.get_rng_state().float()}, 'not a torch generator state'),
    ({'torch': torch.get_rng_state(), 'cuda': [torch.zeros(3)] * 9},
     'saved on another set of CUDA devices'),
])
def test_a_state_this_process_could_not_write_is_refused(state, reason):
    assert random_state.refusal(state) == reason
    resumed = random_state.ResumedRandomState()
    before = torch.get_rng_state()
    resumed.loaded({'random_state': state, 'meta': {'iter': 2}})
    resumed.before_iteration(_runner(2))
    assert torch.equal(torch.get_rng_state(), before)
