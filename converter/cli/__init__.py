"""The ``marlin-convert`` and ``marlin-verify`` commands (thin: parse, call, render).

Exit codes: 0 success; 1 verification found problems; 2 bad input, bad usage or an
unreadable file (one line on stderr naming the file, the tensor and the rule; the
traceback only with ``--debug`` or ``MARLIN_DEBUG=1``); 130 interrupted (Ctrl-C,
SIGTERM, SIGHUP), with every temporary file removed; 141 (:data:`BROKEN_PIPE_EXIT`) the
reader of stdout went away (``| head``), quietly.

One output policy for both: results (the summary or verification table, the problems
found, the status line, ``--json``'s document) go to stdout; progress, notes, warnings
and errors to stderr.  ``-q`` prints nothing but errors (with ``--json``, the document
too), except that ``marlin-verify`` also prints the problems that fail the check and the
status line when it fails; ``-v`` the long form.  With ``--json``, stdout is exactly one JSON document and
stderr stays empty, for usage errors and interrupts too.  Names that come from files
(tensors, layers, file names) are printed with control characters escaped
(:func:`converter.errors.printable`).
"""

from .convert_cmd import FILES_SHOWN, UPSTREAM_LEGEND, convert_app, name_patterns
from .entry import main_convert, main_verify
from .streams import BROKEN_PIPE_EXIT, err_console, out_console
from .verify_cmd import PROBLEM_LINES, cpu_loops_line, nvidia_gpu_present, verify_app

__all__ = [
    "BROKEN_PIPE_EXIT",
    "FILES_SHOWN",
    "PROBLEM_LINES",
    "UPSTREAM_LEGEND",
    "convert_app",
    "cpu_loops_line",
    "err_console",
    "main_convert",
    "main_verify",
    "name_patterns",
    "nvidia_gpu_present",
    "out_console",
    "verify_app",
]
