"""One training step of a segmentor as GradFilterHook runs it (seeded, so
two models compared draw the same), and the lean region's step against
the same step with ``lean=False``, as the zoo families' tests compare
them: the same loss terms (an auxiliary head's may be left out) and the
same gradients."""
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from mmseg_gf.accounting.batch import random_batch, summed_losses
from mmseg_gf.engine.build import build_segmentor
from mmseg_gf.models.segmentor import set_frozen_norms_eval


def plain_model(cfg):
    """The family's plain segmentor: seeded init, perturbed, BN running
    statistics random."""
    torch.manual_seed(0)
    model = build_segmentor(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
        for m in model.modules():
            if isinstance(m, _BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(
                    0.1 * torch.randn(m.num_features, generator=gen))
                m.running_var.copy_(
                    torch.rand(m.num_features, generator=gen) + 0.5)
    return model


def training_step(model, inputs, samples, seed: int = 5,
                  leave_out: tuple = ()):
    """``model.loss``'s outputs as the model returns them (graph and
    ``acc*`` included) and the gradient of every parameter that gets one,
    after one backward of the summed ``loss*`` terms, in training mode
    with frozen norms in eval mode, as GradFilterHook runs a step.
    ``seed`` seeds the step's random draws (dropout, SegNeXt's NMF), so
    two models compared draw the same; terms whose key starts with one of
    ``leave_out`` are not backpropagated (the reference of a step that
    cuts a head off)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    model.train()
    set_frozen_norms_eval(model)
    losses = model.loss(inputs, samples)
    summed_losses({k: v for k, v in losses.items()
                   if not k.startswith(leave_out)}).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return losses, grads


def one_step(model, inputs, samples):
    """Loss terms (each summed, detached) and the gradients of
    :func:`training_step`."""
    losses, grads = training_step(model, inputs, samples)
    return ({k: v.sum().detach() for k, v in losses.items() if 'loss' in k},
            grads)


def check_terms(got, want, where):
    """Every lean term equals the reference's; a term the lean step leaves
    out may only be an auxiliary head's (a frozen head's loss trains
    nothing; the gradients check that)."""
    missing = [k for k in want if k not in got]
    assert set(got) <= set(want), f'{where}: terms {set(got) - set(want)}'
    assert all(k.startswith('aux') for k in missing), (
        f'{where}: lean step lacks {missing}')
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], rtol=1e-5, atol=0,
                                   msg=lambda m: f'{where} {key}: {m}')


def assert_same_step(reference, lean, inputs, samples, where: str,
                     rtol: float, atol_scale: float) -> dict:
    """One step of each on the same batch and random state: the same loss
    terms (:func:`check_terms`), the same parameters with a gradient, each
    gradient equal (``rtol``, ``atol_scale`` x its largest element).
    Returns the reference's gradients."""
    want_terms, want = one_step(reference, inputs, samples)
    got_terms, got = one_step(lean, inputs, samples)
    check_terms(got_terms, want_terms, where)
    assert set(got) == set(want), (
        f'{where}: gradient only with lean {sorted(set(got) - set(want))}'
        f', only without {sorted(set(want) - set(got))}')
    assert want, where
    for key, g in want.items():
        torch.testing.assert_close(
            got[key], g, rtol=rtol, atol=atol_scale * float(g.abs().max()),
            msg=lambda m: f'{where} {key}: {m}')
    return want


def check_lean_step(name: str, cfg, build, size: int, batch: int,
                    check_pair, device: str = 'cpu',
                    modes=('vanilla', 'gf'), ignored_band: bool = True,
                    rtol: float = 1e-5, atol_scale: float = 1e-6):
    """A zoo family's lean and ``lean=False`` steps on ``device`` for each
    of ``modes``: the same loss terms and gradients
    (:func:`assert_same_step`).

    The plain model is :func:`plain_model` of ``cfg``; ``build(plain,
    mode, lean)`` returns the filtered one holding its weights. The batch:
    ``batch`` images of ``size`` x ``size``, random labels in 4x4 blocks,
    the top 4 rows ignored when ``ignored_band`` (so ``ignore_index`` is
    exercised). ``check_pair(reference, lean, mode, where)`` checks the two
    models before their step: that the lean one does have lean modules,
    else the comparison is vacuous."""
    plain = plain_model(cfg)
    inputs, samples = random_batch(plain, (size, size), batch,
                                   device=device, label_block=4)
    if ignored_band:
        for sample in samples:
            sample.gt_sem_seg.data[:, :4] = 255
    for mode in modes:
        reference = build(plain, mode, False).to(device)
        lean = build(plain, mode, True).to(device)
        where = f'{name} {mode} {device}'
        check_pair(reference, lean, mode, where)
        assert_same_step(reference, lean, inputs, samples, where,
                         rtol=rtol, atol_scale=atol_scale)
