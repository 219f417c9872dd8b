"""One module per ``kvdiag`` subcommand (``cli`` finds them), and their private helpers
(underscore modules).

Top layer: may import every other package; nothing imports it but ``kvdiag.cli``.
"""
