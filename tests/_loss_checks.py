"""A lean decode head's ``loss_by_feat`` against the plain one: the same
loss values (float32, rtol 1e-5) and the same gradient w.r.t. the logits."""
import torch


def assert_same_loss_by_feat(plain, lean, logits0, samples):
    """Run both heads' ``loss_by_feat`` on copies of ``logits0``, backward
    the sum of their ``loss*`` outputs and compare."""
    results = []
    for head in (plain, lean):
        logits = logits0.clone().requires_grad_(True)
        out = head.loss_by_feat(logits * 1.0, samples)
        sum(v for k, v in out.items() if 'loss' in k).backward()
        results.append((out, logits.grad))
    (want, want_grad), (got, got_grad) = results
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5,
                               atol=1e-7 * float(want_grad.abs().max()))
