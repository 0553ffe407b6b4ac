from fbtrain.cli import main

main()
