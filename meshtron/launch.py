"""`meshtron-run`: torchrun, with a failed job's end in a line or two.

    meshtron-run --nproc-per-node 4 recipes/train.py --dp 2 --tp 2 --steps 50

It takes torchrun's arguments and starts the same elastic agent
(torch.distributed.run), so a job runs exactly as under torchrun. The
difference is a job's failure: torchrun raises it out of its own main, which
prints its own 16-line traceback and a 14-line summary box after the worker's
one-line error; no worker can shorten that. Here the first failure is one line
(rank, exit code, the worker's message from its error file) and the exit
code is the worker's. torchrun also prints a 4-line banner when it sets
OMP_NUM_THREADS=1 for you (more than one process per node, the variable unset);
this sets the same value in the same case, silently.
"""
from __future__ import annotations

import logging
import os
import sys


def failure_line(error) -> str:
    """One line for a torchrun ChildFailedError: its first failure, and how many ranks failed on their own."""
    rank, failure = error.get_first_failure()
    message = failure.message
    if isinstance(message, dict):   # what lifetime.one_line_errors writes: {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    if message.startswith("To enable traceback"):   # no error file: the worker's traceback is above
        message = "see its output above"
    # ranks the agent stopped after the first failure show as signals (SIGTERM): not failures of their own
    others = sum(f.exitcode > 0 for r, f in error.failures.items() if r != rank)
    also = f" ({others} other rank{'s' if others > 1 else ''} failed too)" if others else ""
    return f"meshtron-run: {error.name} failed on rank {rank} (exit code {failure.exitcode}): {message}{also}"


def main(argv=None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    if torchrun.determine_local_world_size(args.nproc_per_node) > 1:   # where torchrun would, and no more
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the agent logs each failed worker with its pid and binary; the line below says it once
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        print(failure_line(e), file=sys.stderr, flush=True)
        code = e.get_first_failure()[1].exitcode
        sys.exit(code if code > 0 else 1)


if __name__ == "__main__":
    main()
