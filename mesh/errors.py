"""The one exception type for bad user input.

Anything raised as `UserError` is shown by the CLIs as a single line (no traceback) and exits
with status 2. Every message names the culprit and the valid choices.
"""


class UserError(ValueError):
    """Bad configuration or input, reported to the user as one line."""
