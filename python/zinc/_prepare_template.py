"""zinc.prepare's chat templates: compiled in a bounded jinja2 sandbox (compile_chat_template: what a template
builds is at most MAX_RENDER_CHARS), rendered under a deadline (MAX_RENDER_SECONDS), and the character spans of
a conversation's assistant turns (ChatRenderer). See prepare.py for the tool.

The bounds are read here, at each use: a test or a caller lowers them by setting this module's
MAX_RENDER_CHARS and MAX_RENDER_SECONDS (zinc.prepare's names are copies)."""
from __future__ import annotations

import json
import re
import signal
import threading
from datetime import datetime
from typing import Any, Callable, Optional

from ._prepare_common import BadRecord, PrepareError
from ._prepare_tokenizer import TokenizerInfo

MAX_RENDER_CHARS = 1 << 24  # a chat template's rendering of a record, and any string or list it builds, at most
MAX_RENDER_SECONDS = 10.0  # a record's renderings at most (enforced on the main thread, by SIGALRM)
# What one rendering may build in all (the characters or items of every string, list or dict its
# operations, calls and filters return): each is bounded by MAX_RENDER_CHARS, but 150 of them kept in a
# namespace list held 2.4 GB.
MAX_RENDER_BUILT = 4 * MAX_RENDER_CHARS
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _Built:
    """What the rendering in progress has built in all (ChatRenderer.render resets it)."""
    total = 0


def _check_built(value: Any, what: str) -> Any:
    """value, unless it is a string, list, tuple or dict longer than MAX_RENDER_CHARS, or one that takes the
    rendering's total past MAX_RENDER_BUILT (a BadRecord)."""
    if isinstance(value, (str, list, tuple, dict)):
        unit = "characters" if isinstance(value, str) else "items"
        if len(value) > MAX_RENDER_CHARS:
            raise BadRecord(f"the chat template builds {what} of {len(value):,} {unit}, more than "
                            f"{MAX_RENDER_CHARS:,}")
        _Built.total += len(value)
        if _Built.total > MAX_RENDER_BUILT:
            raise BadRecord(f"the chat template builds more than {MAX_RENDER_BUILT:,} characters and items in all "
                            f"in one rendering (MAX_RENDER_BUILT)")
    return value


def _check_call(obj: Any, args: tuple) -> None:
    """Before a str method runs whose result can outgrow its arguments (replace, join, expandtabs): what it
    would build is not above MAX_RENDER_CHARS ('a' * 16000000).replace('a', 'a' * 100) took 1.6 GB before
    its result was refused)."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    size = None
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = owner.count(args[0]) if args[0] else len(owner) + 1
        if len(args) >= 3 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        size = len(owner) + count * (len(args[1]) - len(args[0]))
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        size = sum(len(x) for x in args[0] if isinstance(x, str)) + len(owner) * max(0, len(args[0]) - 1)
    elif name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else 8
        size = len(owner) + owner.count("\t") * max(0, tab)
    if size is not None and size > MAX_RENDER_CHARS:
        raise BadRecord(f"the chat template's str.{name} would build {size:,} characters, more than "
                        f"{MAX_RENDER_CHARS:,}")


def _check_argument(value: Any) -> None:
    """An argument of a call or filter: an integer above MAX_RENDER_CHARS (a width, a count) is a BadRecord,
    as is a string or list longer than that."""
    if isinstance(value, int) and abs(value) > MAX_RENDER_CHARS:
        raise BadRecord(f"the chat template passes {value:,} to a function or filter, more than {MAX_RENDER_CHARS:,}")
    _check_built(value, "an argument")


def _check_format(fmt: Any) -> None:
    """A format string ('%' or str.format) with a number above MAX_RENDER_CHARS (a width or precision) is a
    BadRecord, checked before it runs: '%1000000000s' would allocate a gigabyte."""
    if not isinstance(fmt, str):
        return
    digits = len(str(MAX_RENDER_CHARS))
    for n in re.findall(r"\d{%d,}" % digits, fmt):
        if len(n) > digits or int(n) > MAX_RENDER_CHARS:
            raise BadRecord(f"the chat template formats with a width or precision above {MAX_RENDER_CHARS:,}")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Before a '*', '**' or '%' runs: what it would build is not above MAX_RENDER_CHARS."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDER_CHARS:
                unit = "characters" if isinstance(seq, str) else "items"
                raise BadRecord(f"the chat template repeats a {type(seq).__name__} of {len(seq):,} {unit} {n:,} "
                                f"times ('*'): {len(seq) * n:,}, more than {MAX_RENDER_CHARS:,}")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 and \
                (abs(left).bit_length() - 1) * right > 8 * MAX_RENDER_CHARS:
            raise BadRecord(f"the chat template raises {left:,} to the power {right:,} ('**'), an integer of more "
                            f"than {8 * MAX_RENDER_CHARS:,} bits")
    elif operator == "%":
        _check_format(left)
        for a in right if isinstance(right, tuple) else (right,):
            _check_argument(a)


class _RenderDeadline:
    """A record's renderings end with a BadRecord after MAX_RENDER_SECONDS (a template looping without end):
    SIGALRM, whose handler runs on the main thread between two bytecodes, so only there, and only when no
    other ITIMER_REAL timer is running (elsewhere: no bound on time, only on size). One C call (a huge sort,
    say) is not interrupted."""

    def __init__(self) -> None:
        self.active = False
        self.previous: Any = None
        self.enabled = (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
                        and signal.getitimer(signal.ITIMER_REAL)[0] == 0)

    def _expired(self, signum: int, frame: Any) -> None:
        if self.active:
            self.active = False
            raise BadRecord(f"the chat template ran past {MAX_RENDER_SECONDS:g} s (MAX_RENDER_SECONDS)")

    def __enter__(self) -> "_RenderDeadline":
        if self.enabled:
            self.previous = signal.signal(signal.SIGALRM, self._expired)
            self.active = True
            signal.setitimer(signal.ITIMER_REAL, MAX_RENDER_SECONDS)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.active = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL if self.previous is None else self.previous)


def compile_chat_template(source: str) -> Any:
    """The template compiled in the jinja2 environment transformers' apply_chat_template uses
    (transformers/utils/chat_template_utils.py, _compile_jinja_template): a sandbox with trim_blocks and
    lstrip_blocks, loop controls, tojson without HTML escaping, raise_exception, strftime_now, and the
    {% generation %} tag (rendered as its body, its span recorded as transformers records it).

    Bounded, where transformers' is not: no string, list or dict above MAX_RENDER_CHARS may be built by '*'
    or '**' (checked before they run), '+' or '%', a call (a macro, a method, a global: its arguments and
    result), a filter (the same) or a namespace attribute; a BadRecord says which. With jinja2's own bound on
    range() (MAX_RANGE) and ChatRenderer's on the rendering's length and time, `{{ content * 100000000 }}`
    or a string doubled in a loop is a bad record in microseconds, not minutes and gigabytes."""
    import functools

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return _check_built(super().call_binop(context, operator, left, right), f"a {operator!r} result")

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            for a in (*args, *kwargs.values()):
                _check_argument(a)
            _check_call(__obj, args)
            return _check_built(super().call(__context, __obj, *args, **kwargs), "a call's result")

        def wrap_str_format(self, value: Any) -> Optional[Callable[..., str]]:
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            _check_format(value.__self__)
            return lambda *args, **kwargs: _check_built(wrapped(*args, **kwargs), "a str.format result")

    def bounded_filter(name: str, f: Callable) -> Callable:
        @functools.wraps(f)  # keeps jinja2's pass_context / pass_eval_context marks
        def bounded(*args: Any, **kwargs: Any) -> Any:
            for a in (*args, *kwargs.values()):
                if name == "format":
                    _check_format(a)
                _check_argument(a)
            if name == "join":  # before it runs, as str.join (an item not a string: its text, about 32)
                items = next((a for a in args if isinstance(a, (list, tuple))), None)
                if items is not None:
                    seps = [a for a in args if isinstance(a, str)]
                    sep = str(kwargs.get("d", seps[0] if seps else ""))
                    size = sum(len(x) if isinstance(x, str) else 32 for x in items) + len(sep) * max(0, len(items) - 1)
                    if size > MAX_RENDER_CHARS:
                        raise BadRecord(f"the chat template's join would build {size:,} characters, more than "
                                        f"{MAX_RENDER_CHARS:,}")
            return _check_built(f(*args, **kwargs), f"the result of the filter {name!r}")
        return bounded

    class GenerationTag(jinja2.ext.Extension):
        # transformers' AssistantTracker: a block's span starts at the characters the rendering has
        # yielded so far (ChatRenderer.render keeps the count in the environment's generation_state).
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            self.environment.has_generation = True
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            rv = caller()
            state = getattr(self.environment, "generation_state", None)
            if state is not None and state.spans is not None:
                state.spans.append((state.emitted, state.emitted + len(rv)))
            return rv

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        # As transformers: dict(...) and dict.fromkeys(...) without the type itself.
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # As transformers: no underscore-prefixed attributes on a namespace.
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, _check_built(value, f"a namespace attribute {name!r}"))

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"underscore-prefixed namespace attribute {name!r}")

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.has_generation = False
    env.generation_state = None
    env.filters["tojson"] = tojson
    env.filters.update({name: bounded_filter(name, f) for name, f in env.filters.items()})
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


class _NotAPrefix(BadRecord):
    """A prefix's rendering that is not a prefix of the conversation's: the turns are then found by markers."""


class _GenerationState:
    """What the {% generation %} tag reads during a rendering: the characters yielded so far, and where to
    put the spans (None: not recorded)."""

    def __init__(self, spans: Optional[list]):
        self.emitted = 0
        self.spans = spans


_MARK = re.compile("\ue000zinc(\\d+)([se])\ue001")


def _mark(i: int, end: str) -> str:
    return f"\ue000zinc{i}{end}\ue001"


def _unmark(text: str) -> tuple[str, dict]:
    """text without the markers, and each marker's (turn, 's' or 'e') -> its offsets in that text."""
    out, where, at, length = [], {}, 0, 0
    for m in _MARK.finditer(text):
        out.append(text[at:m.start()])
        length += m.start() - at
        where.setdefault((int(m.group(1)), m.group(2)), []).append(length)
        at = m.end()
    out.append(text[at:])
    return "".join(out), where


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _agreed(tail: str, rest: str) -> int:
    """How much of `tail` (what a turn's template writes after its content when it ends the conversation)
    the conversation's rendering `rest` repeats: all of it, or as far as agreed up to a newline or the '>'
    of a special token, never into a token both merely begin (Phi-3's "<|end|>\n<|endoftext|>" against
    "<|end|>\n<|user|>": "<|end|>\n")."""
    n = _common_prefix(tail, rest)
    if n == len(tail):
        return n
    while n > 0 and tail[n - 1] not in "\n>":
        n -= 1
    return n


class ChatRenderer:
    """Renders a conversation and finds the character spans of its assistant turns."""

    def __init__(self, info: TokenizerInfo):
        if info.chat_template is None:
            raise PrepareError("the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja); "
                               "pass --chat-template FILE")
        try:
            self.template = compile_chat_template(info.chat_template)
        except Exception as e:
            raise PrepareError(f"the chat template does not compile: {e}")
        self.variables = dict(info.special_tokens)
        self.tagged = bool(getattr(self.template.environment, "has_generation", False))

    def render(self, messages: list, add_generation_prompt: bool = False, tools: Optional[list] = None,
               generation_spans: Optional[list] = None) -> str:
        """The rendering (as jinja2's render() joins it), stopped with a BadRecord as soon as it passes
        MAX_RENDER_CHARS; the {% generation %} blocks' spans appended to generation_spans."""
        parts, length = [], 0
        _Built.total = 0
        env = self.template.environment
        state = _GenerationState(generation_spans)
        env.generation_state = state
        try:
            for part in self.template.generate(messages=messages, tools=tools, documents=None,
                                               add_generation_prompt=add_generation_prompt, **self.variables):
                length += len(part)
                if length > MAX_RENDER_CHARS:
                    raise BadRecord(f"the chat template's rendering passes {MAX_RENDER_CHARS:,} characters")
                parts.append(part)
                state.emitted = length
        finally:
            env.generation_state = None
        return "".join(parts)

    def render_with_spans(self, messages: list, tools: Optional[list] = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendering and its assistant spans; a BadRecord past MAX_RENDER_SECONDS (on the main thread)."""
        with _RenderDeadline():
            return self._render_with_spans(messages, tools)

    def _render_with_spans(self, messages: list, tools: Optional[list]) -> tuple[str, list[tuple[int, int]]]:
        # Note [assistant spans]: a template with {% generation %} blocks says its spans itself, as
        # transformers' return_assistant_tokens_mask takes them. Otherwise each assistant turn is what the
        # conversation adds between the prompt before it (rendered with the generation prompt) and its
        # rendering through that turn. Where those prefixes are not prefixes of the whole (a template that
        # drops earlier turns' reasoning, like Qwen3's; one that writes the end of text only at the very
        # end, like Phi-3's; one that fails on an empty conversation before an opening assistant turn), the
        # turns are found in the whole rendering instead, by markers around their content.
        if self.tagged:
            spans: list = []
            full = self.render(messages, tools=tools, generation_spans=spans)
            return full, [(a, b) for a, b in spans if b > a]
        full = self.render(messages, tools=tools)
        try:
            return full, self._prefix_spans(messages, tools, full)
        except _NotAPrefix:
            pass
        except BadRecord:  # a bound on size or time: the record's, whatever the method
            raise
        except Exception:  # a prefix the template cannot render (the empty conversation)
            pass
        return full, self._marked_spans(messages, tools, full)

    def _prefix_spans(self, messages: list, tools: Optional[list], full: str) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            through = full if i == len(messages) - 1 else self.render(messages[:i + 1], tools=tools)
            if not (full.startswith(through) and through.startswith(before)):
                raise _NotAPrefix(f"the template's rendering of messages[:{i}] is not a prefix of the conversation's")
            if len(through) > len(before):
                spans.append((len(before), len(through)))
        return spans

    def _marked_spans(self, messages: list, tools: Optional[list], full: str) -> list[tuple[int, int]]:
        """Each assistant turn located in the whole rendering by markers around its content: from the end
        of the assistant header before it (what the generation prompt adds) to the end of what the template
        writes after the content when the turn ends the conversation, as far as the whole agrees with it."""
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        for i in turns:
            content = messages[i].get("content", "")
            if not isinstance(content, str) or not content:
                raise BadRecord(f"the template's renderings of the conversation's prefixes are not prefixes of it, "
                                f"and assistant turn {i}'s content is {'empty' if content == '' else 'not a string'}"
                                f", so the turn cannot be located (a template with {{% generation %}} blocks "
                                f"around the assistant turns, passed with --chat-template, says where they are)")
        marked = [dict(m, content=_mark(i, "s") + m.get("content", "") + _mark(i, "e")) if i in turns else m
                  for i, m in enumerate(messages)]
        text, where = _unmark(self.render(marked, tools=tools))
        if text != full or any(len(where.get((i, k), [])) != 1 for i in turns for k in "se"):
            raise BadRecord("the template's renderings of the conversation's prefixes are not prefixes of it, and "
                            "it changes the assistant turns' content, so the turns cannot be located")
        spans, low = [], 0
        for i in turns:
            start, end = where[(i, "s")][0], where[(i, "e")][0]
            if start < low:
                raise BadRecord(f"assistant turn {i} renders before the turn ahead of it")
            try:  # the header: what the generation prompt adds to the conversation before the turn
                prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
                bare = self.render(messages[:i], tools=tools)
                header = prompt[_common_prefix(prompt, bare):]
            except BadRecord:  # a bound on size or time (the deadline fires once: swallowed, the renders
                raise          # after it ran without one)
            except Exception:
                header = ""
            at = full.rfind(header, low, start) if header else -1
            if at >= 0:
                start = at + len(header)
            through, marks = _unmark(self.render(marked[:i + 1], tools=tools))
            tail = through[marks[(i, "e")][0]:] if len(marks.get((i, "e"), [])) == 1 else ""
            end += _agreed(tail, full[end:])
            if end > start:
                spans.append((start, end))
            low = end
        return spans


def normalize_messages(messages: Any) -> list:
    """Checks a chat record's messages and applies transformers' normalisation: keys whose value is None are
    dropped, and a message's reasoning is copied under each name templates read it by."""
    if not isinstance(messages, list) or not messages:
        raise BadRecord("'messages' is not a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRecord(f"messages[{i}] is not an object with a string 'role'")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord("no assistant message")
    return out
