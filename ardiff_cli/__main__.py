from ardiff_cli.entry import main

main()
