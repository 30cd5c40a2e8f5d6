from evalgate.cli import main

main()
