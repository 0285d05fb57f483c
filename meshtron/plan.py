"""`python -m meshtron.plan`: the layout planner's command line (meshtron.planner.plan)."""
from meshtron.planner.plan import main

if __name__ == "__main__":
    main()
