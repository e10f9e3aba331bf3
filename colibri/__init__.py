"""The `colibri` command: subcommand dispatch and `colibri serve`, above both services."""
