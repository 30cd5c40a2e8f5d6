"""Old import path of the HumanEval sandbox, kept for notebooks and scripts that use it.

The sandbox lives in ``evalgate.tasks.humaneval.sandbox``.
"""

from evalgate.tasks.humaneval.sandbox import Limits, Outcome, SandboxError, run_program, run_programs

__all__ = ["Limits", "Outcome", "SandboxError", "run_program", "run_programs"]
