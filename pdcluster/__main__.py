"""`python -m pdcluster` is the `pdcluster` command."""

from pdcluster.cli.main import main

main()
