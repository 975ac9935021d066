"""`python -m molt.eval`: the command; its code is molt/driver/eval.py."""

import sys

from molt.driver import eval as evaluation

if __name__ == "__main__":
    # Hydra would read `--help` as an override and fail with its parse error: answer it here.
    if {"--help", "-h"} & set(sys.argv[1:]):
        print(evaluation.__doc__.strip() + "\n\nEvery key: python -m molt --help [KEY_PREFIX]")
        sys.exit(0)
    evaluation.main()
