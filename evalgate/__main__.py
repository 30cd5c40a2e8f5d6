from evalgate.cli.main import main

main()
