from evalgate.cli.main import entry

entry()
