"""What gradient filtering leaves on mmseg's objects after a training
step: attributes of its own only under the ``_gf_`` prefix
(docs/patching.md)."""
import pytest
import torch

pytest.importorskip('mmseg')

from tests.helpers.engine_fixtures import (  # noqa: E402
    SMALL_BATCH, SMALL_SIZE, build_model, filtered_copy)

from mmseg_gf.accounting.batch import (random_batch,  # noqa: E402
                                       training_loss)
from mmseg_gf.patching import PRIVATE_PREFIX, plain_class  # noqa: E402


def _filtered(base):
    return filtered_copy(base, 5, 4, SMALL_SIZE, mode='gf', lean=True)


@pytest.fixture(scope='module')
def base():
    torch.manual_seed(0)
    return build_model('pspnet_r18')


def test_attributes_set_on_mmseg_objects_share_the_prefix(base):
    model = _filtered(base)
    inputs, samples = random_batch(model, SMALL_SIZE, SMALL_BATCH)
    training_loss(model, inputs, samples).backward()
    plain = dict(base.named_modules())
    for path, module in model.named_modules():
        if plain_class(module).__module__.startswith('mmseg_gf') or \
                path not in plain:
            continue  # the package's own modules
        added = set(vars(module)) - set(vars(plain[path]))
        assert all(k.startswith(PRIVATE_PREFIX) for k in added), \
            (path, sorted(added))
