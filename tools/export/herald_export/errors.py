"""Typed errors of the exporter.

Every problem with the input is raised as :class:`ExportError` naming the file and the
problem; the command line prints ``error: <file>: <problem>`` on one line and exits 2.
"""

from __future__ import annotations

from pathlib import Path


class ExportError(Exception):
    """A problem with the exporter's input (checkpoint, arguments).

    ``path`` is the file (or directory) at fault; ``problem`` says what is wrong with it.
    """

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
