from mlora.cli.app import main

main()
