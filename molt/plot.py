"""`python -m molt.plot`: the command; its code is molt/driver/plot.py."""

from molt.driver.plot import main

if __name__ == "__main__":
    main()
