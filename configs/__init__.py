"""Built-in configs, installed as the package ``ardiff_cli.configs``. Address them by file stem."""
