"""`python -m pdcluster` is the `pdcluster` command."""

from pdcluster.cli.main import main

if __name__ == "__main__":   # not when a spawned child (a tensor-parallel rank) imports it
    main()
