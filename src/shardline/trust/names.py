"""Names that cross the wire and end up in keys, file names and logs: model names and instance ids.

Validated where they are parsed, so a frame carrying `../x` or a key expression is refused as malformed
before anything uses it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import StringConstraints

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
NameOrEmpty = Annotated[str, StringConstraints(pattern=r"^$|" + NAME_PATTERN[1:])]
