"""`python -m server`: same as the `deepinfer-server` console script."""

from server.cli import main

if __name__ == "__main__":
    main()
