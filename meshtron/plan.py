"""`python -m meshtron.plan`: the layout planner's command line (meshtron.planner.cli);
`python -m meshtron.plan calibrate ...` measures a GPU or fits the multi-GPU terms
(meshtron.planner.calibrate, which imports the planner: dispatched here, not there)."""
import sys


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:
        from meshtron.planner.calibrate import main as calibrate
        return calibrate(argv[1:])
    from meshtron.planner.cli import main as plan
    return plan(argv)


if __name__ == "__main__":
    main()
