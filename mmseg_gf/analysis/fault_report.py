"""The fault-injection benchmark's table (:mod:`.fault_injection`): each
kill, where it landed, what it cost and whether the run ended with the
uninterrupted run's weights."""
from typing import Any, Dict, List

__all__ = ['kill_where', 'fault_markdown']


def kill_where(kill: Dict[str, Any]) -> str:
    """Where a kill landed, in words."""
    cut = ', '.join(kill.get('partial') or [])
    if kill['kind'] == 'write':
        return (f'inside write {kill["write"]} ({cut}), after '
                f'{kill["fraction"]:.0%} of its bytes')
    return (f'{kill["delay"]:.2f} s after the start (iteration '
            f'{kill["reached"]} completed' +
            (f'; inside the write of {cut})' if cut else ')'))


def fault_markdown(result: Dict[str, Any], command: str, cpu: str) -> str:
    """The markdown of a :func:`.fault_injection.run_fault_injection`
    result, with the command and the CPU that produced it."""
    s = result['setting']
    lines: List[str] = [
        '# Fault injection: SIGKILL during training and checkpoint writes',
        '',
        f'Command: `{command}`',
        '',
        f'CPU: {cpu}. The demo setting shrunk to {s["max_iters"]} '
        f'iterations, crop {s["crop"]}, batch {s["batch_size"]}, a '
        f'checkpoint every {s["interval"]} iterations, max_keep_ckpts '
        f'{s["max_keep_ckpts"]}, pipeline `{s["pipeline"]}`; '
        f'{result["seconds_per_iter"]:.2f} s per iteration in the '
        'uninterrupted run (training and checkpoint writes; each child also '
        'builds its Runner first).',
        '',
        f'**{result["identical"]} of {result["total_kills"]} kills** '
        f'({result["in_write"]} inside a checkpoint write, '
        f'{result["planned_in_write"]} of them placed there) resumed to the '
        'uninterrupted run\'s final weights bit for bit; the most '
        f'iterations one kill cost: {result["max_cost"]}.',
        '',
        '| # | episode | kind | where | resumed from | iterations lost '
        '| final weights |',
        '|---|---|---|---|---|---|---|',
    ]
    for i, k in enumerate(result['kills'], 1):
        lines.append(
            f'| {i} | {k["episode"]} | {k["kind"]} | {kill_where(k)} | '
            f'iter {k.get("resumed_from", "?")} | {k.get("cost", "?")} | '
            f'{"identical" if k["identical"] else "DIFFERENT"} |')
    lines += ['', '| episode | kills | identical tensors | differing | '
              'largest difference |', '|---|---|---|---|---|']
    for i, e in enumerate(result['episodes']):
        lines.append(f'| {i} | {e["kills"]} | {e["tensors"] - e["differing"]}'
                     f' of {e["tensors"]} | {e["differing"]} | '
                     f'{e["max_abs_diff"]:.3g} |')
    return '\n'.join(lines) + '\n'
