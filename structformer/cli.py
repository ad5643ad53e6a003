"""`structformer COMMAND`: the command line of the library. The verbs are the rows of `commands.COMMANDS`, one
module per verb (structformer/commands/, and the kinds' own `analysis/cli.py`, `weights/cli.py`, `export/cli.py`,
`design_cli.py`); this module builds the parser from that table and is the net that turns expected failures into
one line."""
import argparse
import os
import sys
from typing import List, Optional

from .commands import COMMANDS, add_commands, run_command
from .errors import expected_failure, one_line

# Nothing heavy at module level: `structformer --help` must answer without importing torch or timm.


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser with its errors in one line, the rule for bad input: argparse's message (the argument and
    what was wrong with it) and where the command's flags are listed, without the usage printed above it (65 lines
    for `train`, where the message scrolled away). The commands' sub-parsers are of this class too (argparse
    makes them of their parent's)."""

    def error(self, message: str):
        hint = '' if '--help' in message else f"; `{self.prog} --help` lists what it takes"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog='structformer', formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description='Structured deep networks (CRATE, SOFT, ...) as timm models: train, evaluate, analyse, benchmark.',
        epilog='run `structformer COMMAND --help` for the options and examples of each command')
    from . import __version__
    parser.add_argument('--version', action='version', version=f'structformer {__version__}')
    sub = parser.add_subparsers(dest='command', metavar='COMMAND')
    sub.required = True
    add_commands(sub, COMMANDS)
    return parser


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command `args` ran: down the sub-parsers by the verb, target or action chosen."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or getattr(args, sub.dest, None) not in sub.choices:
            return parser
        parser = sub.choices[getattr(args, sub.dest)]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def unrecognized(extra: List[str], parser: argparse.ArgumentParser) -> str:
    """One line for the arguments `parser` did not take: each unknown flag named, with where its setting is here
    (the command's FLAG_HINTS: timm train.py's flags that are not ours) or the closest flag of the command;
    argparse's own 'unrecognized arguments: ...' names neither."""
    import difflib
    ours = [o for o in parser._option_string_actions if o.startswith('--')]
    hints = getattr(parser, 'flag_hints', {})
    said = []
    for item in extra:
        flag = item.split('=', 1)[0]
        if not flag.startswith('-') or flag == '-' or _is_number(flag):
            continue                           # the value of an unknown flag just named
        if flag in hints:
            said.append(f"{flag} is not a flag here: {hints[flag]}")
            continue
        close = difflib.get_close_matches(flag, ours, n=2, cutoff=0.75)
        said.append(f"{flag} is not a flag of `{parser.prog}`"
                    + (f" (did you mean {' or '.join(close)}?)" if close else ''))
    if not said:                               # only stray words: a positional argument too many
        return f"unexpected argument(s) {' '.join(extra)!r}; `{parser.prog} --help` lists what it takes"
    return '; '.join(said) + f"; `{parser.prog} --help` lists its flags"


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has gone (`| head` exited); if so it is pointed at /dev/null, so that
    neither the rest of the command nor the interpreter's final flush raises (or prints a traceback) again."""
    import select
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        return False
    if hasattr(select, 'poll'):                  # a write end without readers polls as an error
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poll.poll(0)):
            return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return True


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command. Expected failures -- bad input (UsageError and the project's other validation
    errors), unusable checkpoints, user paths that are missing, not folders or not writable -- end as one
    line, `structformer CMD: error: ...`, and exit status 2, as argparse's own errors do. Anything else is
    a bug and keeps its traceback."""
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):     # a bare `structformer`: its commands, as --help lists them
        parser.print_help(sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:                                  # argparse's error, from the command's parser, saying where to look
        _command_parser(parser, args).error(unrecognized(extra, _command_parser(parser, args)))
    # as argparse names it in its own errors: the verb and its target or action (`structformer data shard: ...`)
    command = ' '.join([args.command] + [getattr(args, key) for key in ('target', 'action') if getattr(args, key, None)])
    try:
        if any(k.startswith('STRUCTFORMER_CHOICE_') or k == 'STRUCTFORMER_AUTOTUNE' for k in os.environ):
            from .functional.autotune import check_environment    # only then: torch stays unimported otherwise
            check_environment()
        return run_command(COMMANDS, args.command, args)
    except BrokenPipeError:
        if not _stdout_gone():                  # a pipe of the command's own: a bug, keep its traceback
            raise
        return 141                              # `structformer models | head`: the reader stopped; as SIGPIPE's
    except KeyboardInterrupt as e:              # Ctrl-C, or SIGTERM during training (exit status 143)
        said = getattr(e, 'said', None) or 'checkpoints already written are intact'   # a command may say what it kept
        print(f"structformer {command}: interrupted; {said}", file=sys.stderr)
        return getattr(e, 'exit_status', 130)
    except Exception as e:
        step = sys.modules.get('structformer.train.step')       # only a loaded training step can diverge
        if step is not None and isinstance(e, step.TrainingDiverged):
            print(f"structformer {command}: stopped: {e}", file=sys.stderr)
            return 1
        if not expected_failure(e):
            raise
        print(f"structformer {command}: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
