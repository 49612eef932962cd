from phalanx.cli.main import main

main()
