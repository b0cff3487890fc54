"""Bad input, as one type: the error a person fixes by changing a config key, a flag or a file.

A ``UserError``'s message is one line that names the key (or flag, or file) and the fix. The CLIs
print it as ``error: <message>`` and exit with code 2, whether it was found before any rank started
or inside a rank (a rank started by the local launcher reports it to the launcher, which prints the
first one once). Any other exception is a failure of the run, not of its input (exit code 1).
This module imports nothing, so every layer can raise these.
"""


class UserError(Exception):
    """Bad input (config, flags, files); the message names the key and the fix."""


class DataError(UserError, ValueError):
    """A data file that cannot be used (missing, empty, not UTF-8, malformed lines); names the file."""
