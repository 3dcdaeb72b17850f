"""One module per CLI command. Each defines COMMAND (a tuple path such as ("bench", "prefill")),
HELP, add_arguments(parser) and run(args) -> int. serving/cli.py discovers them."""
