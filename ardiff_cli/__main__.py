from ardiff_cli.app import main

main()
