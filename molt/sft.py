"""`python -m molt.sft [+experiment=NAME] [key=value ...]`: `python -m molt` with train.objective=sft (the
same spec, run directory, checkpoints and exports; molt/driver/sft_loop.py instead of the RL loop)."""

import sys

from molt.__main__ import main

if __name__ == "__main__":
    sys.argv.insert(1, "train.objective=sft")
    main()
