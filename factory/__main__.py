"""`python -m factory ...` is the `factory` command."""
from factory.commands.cli import main

raise SystemExit(main())
