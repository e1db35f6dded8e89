"""The `factory` command line (cli.py) and the commands that are more than a call into the runtime:
init, export, rescore, diff, the spec reference."""
