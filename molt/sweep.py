"""`python -m molt.sweep`: the command; its code is molt/driver/sweep.py."""

from molt.driver.sweep import main

if __name__ == "__main__":
    main()
