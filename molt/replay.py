"""`python -m molt.replay`: the command; its code is molt/driver/replay.py."""

import sys

from molt.driver.replay import main

if __name__ == "__main__":
    sys.exit(main())
