"""Supervised fine-tuning data: chat conversations and prompt/completion pairs -> token ids and a
loss weight per token (1 on what the model should learn to write, 0 on everything else).

Row formats (`data.format`), read from JSONL or Parquet, with TRL's field names:
  chat               {"messages": [{"role": "system" | "user" | "assistant" | ..., "content": str}, ...]};
                     a ShareGPT or Alpaca row (below) is recognised by its fields and read as one
  sharegpt           {"conversations": [{"from": "system" | "human" | "gpt" | ..., "value": str}, ...]}
  alpaca             {"instruction": str, "input": str (optional), "output": str, "system": str (optional),
                      "history": [[instruction, output], ...] (optional, the earlier turns)}
  prompt_completion  {"prompt": str, "completion": str}
Other fields of a row are ignored. ShareGPT and Alpaca rows become `messages` as soon as they are read
(`ROLES`; Alpaca's user turn is the instruction, then a newline and the input when there is one, as
LLaMA-Factory converts them), so the same conversation in any of the three gives the same example:
the same ids, weights and validation split.

A conversation is rendered to text with a Jinja chat template (`data.chat_template`: "" = the
tokenizer's own, `chatml`, `simple`, or a .jinja file), as transformers' `apply_chat_template` renders
it: the same sandbox (`ImmutableSandboxedEnvironment`: a template from a checkpoint is untrusted) and
the same globals (`messages`, `bos_token`, `eos_token`, `add_generation_prompt`, `raise_exception`,
`strftime_now`). The ids are exactly the tokenization of the whole rendered text (special tokens'
text, e.g. "<|im_end|>" or a SentencePiece "</s>", becomes their ids). Weight 1 goes to the tokens of
each assistant turn: from the end of the prompt the template renders for it (the rendering of the
messages before it with `add_generation_prompt`) to the end of its turn (the rendering through it,
trailing whitespace excluded), so the content and the end-of-turn marker after it ("<|im_end|>",
"<|eot_id|>", EOS) are learned and the model learns to stop; the system and user turns and the
template's headers weigh 0. The spans are found by rendering each prefix of the conversation, which
needs a template that renders a prefix as a prefix of the whole (every common one does; one that
rewrites earlier turns, such as dropping past reasoning, is refused with one line). A token that
straddles a span's edge (a merge across it) is counted in.

prompt_completion rows need no template: the ids are BOS + tokens of prompt + completion + EOS, the
completion's tokens and the EOS weigh 1 (write the separator between the two into the data).

Each example is one document of the packing pipeline (`pipeline.FlatDocuments` with weights);
one longer than seq_len + 1 tokens is truncated there, and `Stats` counts those.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import pathlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxlm.data import sources
from jaxlm.data.tokenizer import HFTokenizer, Tokenizer, read_limited
from jaxlm.errors import UserError

CONVERSATIONS = sources.CONVERSATIONS  # the formats whose rows are conversations (rendered with a template)
FORMATS = sources.SFT_FORMATS
# ShareGPT speakers (`from`) -> messages roles. "tool" stays itself (the template renders or refuses it); a speaker
# not here (function_call, observation, ...) is refused in one line rather than guessed.
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "system": "system", "tool": "tool"}
_MAX_TEMPLATE_BYTES = 1_000_000

# ChatML (Qwen, many others): any role, "<|im_start|>role\ncontent<|im_end|>\n". BOS first where the
# tokenizer has one (Qwen's has none), as pre-training documents begin.
CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Plain headers any tokenizer spells (one trained here has no chat tokens); EOS ends each answer, so
# that generation stops there.
SIMPLE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '### System:\\n' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### User:\\n' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '### Assistant:\\n' + message['content'] + eos_token + '\\n\\n' }}"
    "{% else %}{{ raise_exception('the simple template takes the roles system, user and assistant, not '"
    " + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Assistant:\\n' }}{% endif %}"
)
TEMPLATES = {"chatml": CHATML, "simple": SIMPLE}


@dataclasses.dataclass(frozen=True)
class Spec:
    """How rows become examples: `format` (FORMATS) and `chat_template` ("" = the tokenizer's own, a
    name in TEMPLATES, or a .jinja file)."""

    format: str
    chat_template: str = ""


@dataclasses.dataclass(frozen=True)
class Example:
    """One validated row: `where` it came from ('file:line') and its fields (messages, or prompt and completion)."""

    where: str
    fields: dict[str, Any]

    @property
    def key(self) -> str:
        """The text the validation split hashes (`sources.is_validation`): the row's content, not its place."""
        return json.dumps(self.fields, sort_keys=True, ensure_ascii=False)


# ----------------------------------------------------------------------------- reading rows


def iter_examples(source: sources.SourceSpec, fmt: str) -> Iterator[Example]:
    """Every row of the source's JSONL / Parquet files, in order, checked (one UserError naming the
    file and line for the first bad one)."""
    for path in sources.resolve_files(source):
        for where, row in sources.read_file_records(path):
            yield check_row(row, fmt, where)


def check_row(row: Any, fmt: str, where: str) -> Example:
    """The example of one row of format `fmt` (FORMATS), or a UserError naming `where` and what to change."""
    if fmt in CONVERSATIONS:
        return Example(where, {"messages": _check_messages(_conversation(row, fmt, where), where)})
    if fmt != "prompt_completion":
        raise UserError(f"SFT format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    shape = 'each row must be {"prompt": str, "completion": str} (data.format=prompt_completion)'
    if not isinstance(row, dict):
        raise UserError(f"{where}: a JSON {type(row).__name__}, not an object; {shape}")
    for key in ("prompt", "completion"):
        if key not in row:
            raise UserError(f"{where}: no field {key!r} (found: {', '.join(sorted(row)) or 'none'}); {shape}")
        if not isinstance(row[key], str):
            raise UserError(f"{where}: {key!r} is a {type(row[key]).__name__}, not a string; {shape}")
    if not row["completion"].strip():
        raise UserError(f"{where}: the completion is empty: nothing to train on; give it text or drop the row")
    return Example(where, {"prompt": row["prompt"], "completion": row["completion"]})


_SHAPES = {
    "chat": 'each row must be {"messages": [{"role": ..., "content": ...}, ...]}, or a ShareGPT or Alpaca row '
            '(data.format=chat)',
    "sharegpt": 'each row must be {"conversations": [{"from": ..., "value": ...}, ...]} (data.format=sharegpt)',
    "alpaca": 'each row must be {"instruction": ..., "input": ... (optional), "output": ...} (data.format=alpaca)',
}

_OTHER_FORMAT = "; data.format=chat reads messages, ShareGPT and Alpaca rows alike"


def _conversation(row: Any, fmt: str, where: str) -> Any:
    """The `{"messages": [...]}` of a row of conversation format `fmt`: a messages row as it is, a
    ShareGPT or Alpaca row converted (under `chat`, whichever its fields say it is)."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: a JSON {type(row).__name__}, not an object; {_SHAPES[fmt]}")
    if fmt == "chat":
        fmt = "chat" if "messages" in row else "sharegpt" if "conversations" in row else (
            "alpaca" if "instruction" in row else "chat")
    if fmt == "sharegpt":
        return {"messages": _sharegpt_messages(row, where)}
    if fmt == "alpaca":
        return {"messages": _alpaca_messages(row, where)}
    if "messages" not in row:
        hint = ("; these are prompt/completion rows: set data.format=prompt_completion"
                if "prompt" in row and "completion" in row else "")
        raise UserError(f"{where}: no field 'messages' (found: {', '.join(sorted(row)) or 'none'}){hint}; {_SHAPES[fmt]}")
    return row


def _sharegpt_messages(row: dict, where: str) -> list[dict[str, str]]:
    shape = _SHAPES["sharegpt"]
    if "conversations" not in row:
        raise UserError(f"{where}: no field 'conversations' (found: {', '.join(sorted(row)) or 'none'}); {shape}"
                        f"{_OTHER_FORMAT if 'messages' in row or 'instruction' in row else ''}")
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: 'conversations' must be a non-empty list; {shape}")
    messages = []
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not turn["from"]:
            raise UserError(f"{where}: message {number} has no 'from' string; {shape}")
        if turn["from"] not in ROLES:
            raise UserError(f"{where}: message {number} is from {turn['from']!r}, which is no ShareGPT role jaxlm "
                            f"reads ({', '.join(ROLES)}); rename it, or write the row as messages")
        if not isinstance(turn.get("value"), str):
            raise UserError(f"{where}: message {number} ({turn['from']}) has no 'value' string; {shape}")
        messages.append({"role": ROLES[turn["from"]], "content": turn["value"]})
    return messages


def _alpaca_messages(row: dict, where: str) -> list[dict[str, str]]:
    """system (if given), the history's turns, then the instruction (and input) and the output."""
    shape = _SHAPES["alpaca"]
    for key in ("instruction", "output"):
        if key not in row:
            raise UserError(f"{where}: no field {key!r} (found: {', '.join(sorted(row)) or 'none'}); {shape}"
                            f"{_OTHER_FORMAT if 'messages' in row or 'conversations' in row else ''}")
    for key in ("instruction", "output", "input", "system"):
        if row.get(key) is not None and not isinstance(row[key], str):  # (a Parquet column holds null for none)
            raise UserError(f"{where}: {key!r} is a {type(row[key]).__name__}, not a string; {shape}")
    if not (row["output"] or "").strip():
        raise UserError(f"{where}: the output is empty: nothing to train on; give it text or drop the row")
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    history = row.get("history") or []
    if not isinstance(history, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair) for pair in history):
        raise UserError(f"{where}: 'history' must be a list of [instruction, output] string pairs; {shape}")
    for instruction, output in history:
        messages += [{"role": "user", "content": instruction}, {"role": "assistant", "content": output}]
    prompt = "\n".join(part for part in (row["instruction"] or "", row.get("input") or "") if part)
    return [*messages, {"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]


def _check_messages(row: Any, where: str) -> list[dict[str, str]]:
    shape = _SHAPES["chat"]
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list; {shape}")
    checked = []
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise UserError(f"{where}: message {number} has no 'role' string; {shape}")
        if not isinstance(message.get("content"), str):
            raise UserError(f"{where}: message {number} ({message['role']}) has no 'content' string; {shape}")
        if message["role"] == "assistant" and not message["content"].strip():
            raise UserError(f"{where}: message {number} (assistant) is empty; give it text or drop the row")
        checked.append({"role": message["role"], "content": message["content"]})
    if not any(m["role"] == "assistant" for m in checked):
        raise UserError(f"{where}: no assistant message, so nothing to train on; drop the row or add the answer")
    return checked


PROMPT_ROLES = ("system", "user", "assistant")  # the roles of a conversation given to generation


def check_prompt(row: Any, where: str) -> list[dict[str, str]]:
    """A conversation to answer (`jaxlm.generate --chat`, `explore.chat`): a JSON list of {role,
    content} messages, or {"messages": [...]}; roles from PROMPT_ROLES, the last one not the
    assistant's (the model writes the next assistant turn). One UserError naming `where` otherwise."""
    shape = 'give a list of {"role": "system" | "user" | "assistant", "content": str} messages, or {"messages": [...]}'
    if isinstance(row, dict) and "messages" in row:
        row = row["messages"]
    if not isinstance(row, list) or not row:
        kind = "an empty list" if row == [] else f"a JSON {type(row).__name__}"
        raise UserError(f"{where}: {kind}, not a conversation; {shape}")
    checked = []
    for number, message in enumerate(row, 1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise UserError(f"{where}: message {number} has no 'role' string; {shape}")
        if message["role"] not in PROMPT_ROLES:
            raise UserError(f"{where}: message {number} has role {message['role']!r}; use one of "
                            f"{', '.join(PROMPT_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise UserError(f"{where}: message {number} ({message['role']}) has no 'content' string; {shape}")
        checked.append({"role": message["role"], "content": message["content"]})
    if checked[-1]["role"] == "assistant":
        raise UserError(f"{where}: the last message is the assistant's; end with a user message for the model "
                        f"to answer")
    return checked


# ----------------------------------------------------------------------------- templates


def template_text(name: str, tok: Tokenizer | None) -> tuple[str, str]:
    """(Jinja source, a name for messages) of data.chat_template=`name`: "" = `tok`'s own."""
    if not name:
        if tok is None or not tok.chat_template:
            kind = "this tokenizer" if tok is not None else "a tokenizer trained here"
            raise UserError(f"{kind} has no chat template; set data.chat_template to chatml, simple or a .jinja file "
                            f"(prepare: --chat_template)")
        return tok.chat_template, "the tokenizer's chat template"
    if name in TEMPLATES:
        return TEMPLATES[name], f"chat template {name!r}"
    path = pathlib.Path(name).expanduser()
    if not path.is_file():
        raise UserError(f"data.chat_template={name!r} is neither a built-in template ({', '.join(TEMPLATES)}) nor a "
                        f"file; give one of those or the path of a .jinja file")
    data = read_limited(path, _MAX_TEMPLATE_BYTES, "chat template")
    try:
        return data.decode("utf-8"), str(path)
    except UnicodeDecodeError:
        raise UserError(f"{path}: a chat template must be UTF-8 text") from None


def template_identity(name: str) -> str:
    """What data.chat_template=`name` stands for, for cache keys: the sha256 of a built-in's or a
    file's text; "" for the tokenizer's own (the tokenizer's identity holds it)."""
    if not name:
        return ""
    try:
        text, _ = template_text(name, None)
    except (UserError, OSError):
        return f"unreadable:{name}"  # loading it raises the clear error
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _environment():
    """The Jinja environment transformers renders chat templates in (utils/chat_template_utils.py)."""
    # local import: start-up time (only chat templates need jinja2; prepare's workers import this module)
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (its assistant-mask tag): rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    class Namespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscore names, as transformers' (no reaching into internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=Namespace)
    return env


@functools.lru_cache(maxsize=16)
def _compiled(text: str, name: str):
    import jinja2  # local import: start-up time, as in `_environment`

    try:
        return _environment().from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"{name}: not a valid Jinja template (line {e.lineno}: {e.message})") from None


# ----------------------------------------------------------------------------- encoding


class Encoder:
    """Example -> (int32 ids [n], uint8 weights [n]) with a tokenizer and, for chat, a template.

    Pickles as its format and template text (grain and prepare workers get it). `render` and
    `prompt_ids` serve generation: the text and ids a chat model is prompted with.
    """

    def __init__(self, fmt: str, template: str | None = None, template_name: str = "the chat template"):
        if fmt not in FORMATS:
            raise UserError(f"SFT format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
        self.format, self.template, self.template_name = fmt, template, template_name

    @classmethod
    def make(cls, spec: Spec, tok: Tokenizer | None) -> Encoder:
        """The encoder of `spec` with tokenizer `tok` (whose own template "" stands for)."""
        if spec.format not in CONVERSATIONS:
            return cls(spec.format)
        return cls(spec.format, *template_text(spec.chat_template, tok))

    @property
    def template_sha256(self) -> str:
        return hashlib.sha256((self.template or "").encode()).hexdigest()

    def __call__(self, tok: Tokenizer, example: Example) -> tuple[np.ndarray, np.ndarray]:
        if self.format == "prompt_completion":
            return self._prompt_completion(tok, example)
        messages = example.fields["messages"]
        renders: dict[tuple[int, bool], str] = {}

        def render(upto: int, generation_prompt: bool = False) -> str:
            if (upto, generation_prompt) not in renders:
                renders[upto, generation_prompt] = self.render(tok, messages[:upto], generation_prompt, example.where)
            return renders[upto, generation_prompt]

        full = render(len(messages))
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, after = render(i, True), render(i + 1)
            if not (full.startswith(before) and full.startswith(after)):
                raise UserError(
                    f"{example.where}: {self.template_name} does not render the conversation up to message {i + 1} "
                    f"as the start of the whole (it rewrites earlier turns), so the assistant's tokens cannot be "
                    f"found; set data.chat_template to chatml, simple or a .jinja file that does")
            start = len(before)
            if before == render(i):  # the template ignores add_generation_prompt: the reply starts at its text
                found = full.find(message["content"].strip(), start, len(after))
                start = found if found >= 0 else start
            end = max(len(after.rstrip()), start)  # the end-of-turn marker, not the whitespace between turns
            if end == start:
                raise UserError(f"{example.where}: {self.template_name} renders assistant message {i + 1} as "
                                f"nothing; check the template")
            spans.append((start, end))
        return _tokens_and_weights(functools.partial(encode_rendered, tok), full, spans)

    def _prompt_completion(self, tok: Tokenizer, example: Example) -> tuple[np.ndarray, np.ndarray]:
        prompt, completion = example.fields["prompt"], example.fields["completion"]
        text = prompt + completion

        def encode(t: str) -> list[int]:
            return tok.encode([t], add_bos=False, add_eos=False, num_threads=1)[0]

        ids, weights = _tokens_and_weights(encode, text, [(len(prompt), len(text))])
        bos, eos = int(tok.bos_id >= 0), int(tok.eos_id >= 0)
        ids = np.concatenate([[tok.bos_id] * bos, ids, [tok.eos_id] * eos]).astype(np.int32)
        weights = np.concatenate([[0] * bos, weights, [1] * eos]).astype(np.uint8)  # EOS: learn to stop
        return ids, weights

    def render(self, tok: Tokenizer, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False,
               where: str = "") -> str:
        """The template's text of `messages` (plain dicts of role and content)."""
        import jinja2  # local import: start-up time, as in `_environment`

        if self.template is None:
            raise UserError("a prompt_completion encoder has no chat template")
        template = _compiled(self.template, self.template_name)
        try:
            return template.render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                bos_token=tok.token_text(tok.bos_id), eos_token=tok.token_text(tok.eos_id),
                pad_token=tok.token_text(tok.pad_id), unk_token=tok.token_text(tok.unk_id))
        except jinja2.TemplateError as e:  # raise_exception, an undefined name, a sandbox refusal
            raise UserError(f"{where or 'a conversation'}: {self.template_name} refuses it: {e.message or e}") from None
        except Exception as e:  # noqa: BLE001 -- the template is user code: its own error ({{ 1 // 0 }}, a range limit)
            raise UserError(f"{where or 'a conversation'}: {self.template_name} failed rendering it: "
                            f"{type(e).__name__}: {e}; fix the chat template") from None

    def stop_ids(self, tok: Tokenizer) -> tuple[int, ...]:
        """The ids a chat answer ends at: EOS, and the template's end-of-turn marker when it is another
        special token (ChatML's <|im_end|> with a tokenizer whose EOS is <|endoftext|>, Llama 3's
        <|eot_id|>): the first token after an answer in a rendered conversation, if it decodes to no
        text. Training weighs that marker (the model learns to emit it); generation stops at it."""
        stops = [tok.eos_id] if tok.eos_id >= 0 else []
        mark = "jaxlm-answer-end"
        try:
            text = self.render(tok, [{"role": "user", "content": "?"}, {"role": "assistant", "content": mark}],
                               add_generation_prompt=False)
        except UserError:  # a template that renders no such conversation: EOS alone
            return tuple(stops)
        after = text[text.rindex(mark) + len(mark):].strip() if mark in text else ""
        ids = encode_rendered(tok, after) if after else []
        if ids and ids[0] not in stops and tok.decode([ids[0]]).strip() == "":
            stops.append(ids[0])
        return tuple(stops)

    def prompt_ids(self, tok: Tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
        """The ids a chat model is prompted with: `messages` rendered with the generation prompt."""
        return encode_rendered(tok, self.render(tok, messages, add_generation_prompt=True))


def encode_rendered(tok: Tokenizer, text: str) -> list[int]:
    """The ids of rendered chat text, special tokens' text included: a Hugging Face tokenizer splits
    its added tokens itself; for SentencePiece the text of BOS and EOS ("<s>", "</s>") is cut out and
    replaced by their ids, the text between encoded as it is."""
    if isinstance(tok, HFTokenizer):
        return tok.encode([text], add_bos=False, add_eos=False, num_threads=1)[0]
    specials = {tok.token_text(i): i for i in (tok.bos_id, tok.eos_id) if i >= 0}
    if not specials:
        return tok.encode([text], add_bos=False, add_eos=False, num_threads=1)[0]
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")", text):
        if part in specials:
            ids.append(specials[part])
        elif part:
            ids.extend(tok.encode([part], add_bos=False, add_eos=False, num_threads=1)[0])
    return ids


def _tokens_and_weights(encode: Callable[[str], list[int]], text: str,
                        spans: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """encode(text) as int32, and uint8 weights: 1 on each token that overlaps a character span.

    The token index of each span edge: where the pieces between edges, encoded apart, concatenate
    to the whole's ids, their lengths (exact); otherwise, per edge, the length of the common start
    of encode(text[:edge]) and the whole's ids, plus the straddling token at a span's end.
    """
    ids = encode(text)
    edges = sorted({e for span in spans for e in span})
    bounds = [0, *edges, len(text)]
    pieces = [encode(text[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    index: dict[int, tuple[int, bool]] = {}  # char edge -> (token index, whether a token boundary is there)
    if [i for piece in pieces for i in piece] == ids:
        at = np.cumsum([len(p) for p in pieces])
        index = {edge: (int(at[k]), True) for k, edge in enumerate(edges)}
    else:
        for edge in edges:
            prefix = encode(text[:edge])
            common = next((k for k, (a, b) in enumerate(zip(prefix, ids)) if a != b), min(len(prefix), len(ids)))
            index[edge] = (common, common == len(prefix))
    weights = np.zeros(len(ids), np.uint8)
    for start, end in spans:
        first, _ = index[start]
        last, clean = index[end]
        weights[first : last + (0 if clean else 1)] = 1
    return np.asarray(ids, np.int32), weights


def encode_examples(
    encoder: Encoder, tok: Tokenizer, examples: Sequence[Example]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The ids and weights of each example, in order."""
    ids, weights = [], []
    for example in examples:
        i, w = encoder(tok, example)
        ids.append(i)
        weights.append(w)
    return ids, weights


def tokenizer_texts(examples: Iterator[Example], encoder: Encoder) -> Iterator[str]:
    """Texts to train a tokenizer on: each example rendered with no BOS/EOS text (no tokenizer yet)."""

    class _NoSpecials:  # what render asks of a tokenizer: the specials' text, none here
        bos_id = eos_id = pad_id = unk_id = -1

        @staticmethod
        def token_text(token_id: int) -> str:
            return ""

    for example in examples:
        if encoder.format == "prompt_completion":
            yield example.fields["prompt"] + example.fields["completion"]
        else:
            yield encoder.render(_NoSpecials(), example.fields["messages"], where=example.where)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the report


@dataclasses.dataclass(frozen=True)
class Stats:
    """What the training sees of weighted documents at `seq_len`: examples, tokens (after
    truncation), targets weighing 1, and examples truncated (of which left with no such target)."""

    examples: int
    tokens: int
    trained: int
    truncated: int
    emptied: int
    seq_len: int

    @classmethod
    def of(cls, docs, seq_len: int) -> Stats:
        """Of a weighted `pipeline.FlatDocuments`: each example is its first seq_len + 1 tokens."""
        examples = tokens = trained = truncated = emptied = 0
        for _, offsets, weights in docs.shards:
            offsets = np.asarray(offsets, np.int64)
            lengths = np.diff(offsets)
            if not len(lengths):
                continue
            kept = np.minimum(lengths, seq_len + 1)
            w = np.asarray(weights)
            # Targets are tokens 1..kept-1 of each example: its weights' sum, less the first token's and the cut tail's.
            sums = np.add.reduceat(w, offsets[:-1], dtype=np.int64) - w[offsets[:-1]]
            for doc in np.flatnonzero(lengths > seq_len + 1):
                start = offsets[doc]
                cut = int(w[start + seq_len + 1 : offsets[doc + 1]].sum(dtype=np.int64))
                sums[doc] -= cut
                emptied += int(sums[doc] == 0)
            examples += len(lengths)
            tokens += int(kept.sum())
            trained += int(sums.sum())
            truncated += int((lengths > seq_len + 1).sum())
        return cls(examples, tokens, trained, truncated, emptied, seq_len)

    def describe(self, noun: str) -> str:
        line = (f"{self.examples:,} {noun}, {self.tokens:,} tokens, {self.trained:,} trained on "
                f"({100 * self.trained / max(self.tokens, 1):.1f}%)")
        if self.truncated:
            line += f", {self.truncated:,} truncated to seq_len={self.seq_len}"
            if self.emptied:
                line += f" ({self.emptied:,} with nothing left to train on)"
        return line


def report(spec: Spec, train, val, seq_len: int) -> str:
    """The start-of-run line: 'SFT data: 812 conversations, 96,410 tokens, 41,377 trained on (42.9%), ...'."""
    noun = "conversations" if spec.format in CONVERSATIONS else "examples"
    line = f"SFT data: {Stats.of(train, seq_len).describe(noun)}"
    if len(val):
        held = Stats.of(val, seq_len)
        line += f"; {held.examples:,} held out ({held.trained:,} tokens to score)"
    return line
