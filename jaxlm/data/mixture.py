"""Data mixtures: several named sources, each with a weight, and stages that change the weights from a step on.

`data.sources="web=data/web/*.jsonl:0.7,code=builtin:0.3"` names each source (`name=paths:weight`; the
paths as `data.corpus` takes them, several joined by `|`; a weight left out is 1) and `data.stages=
"8000:web=0.3,hq=0.7;9500:hq=1"` gives the weights from a step on (a source a stage does not name weighs 0
there). Weights are relative: each step's are divided by their sum.

How a batch is drawn (`MixtureIterator`): each source is its own stream of packed rows, shuffled, repeated
and sliced as a single corpus is (`pipeline.make_row_stream`), and every row of a batch comes from one
source: for training step s, row r of data shard j is drawn from the sources with step s's weights by a
uniform number fixed by (data.seed, j, s, r). So a row never mixes sources (the row's source is each of its
tokens' source: `source_ids`, for the per-source loss), the draw of a step depends on nothing read before
it, and a stream's position is each source's position plus the step. A resumed run continues exactly; with
other weights (or stages) it draws by them from its first step on and replays or skips nothing, since no
source advances except by the rows it gives. Packing per source costs nothing in padding against packing
the mixture (each source packs into as many bins as the batch has rows).

Not grain's `mix`: its proportions are fixed for the dataset's life and must all be positive, and it
interleaves elements (chunks, before packing), whose count per step varies, so a step's weights could not
be told from the step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxlm import lazy
from jaxlm.errors import UserError
from jaxlm.table import Table

if TYPE_CHECKING:
    import grain

pipeline = lazy.module("jaxlm.data.pipeline")  # (grain's, imported by the first run that reads data)
streams = lazy.module("jaxlm.data.streams")


def __getattr__(name: str):
    if name == "MixtureIterator":  # (defined beside the other grain iterators, `jaxlm.data.streams`)
        return streams.MixtureIterator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a source's name: a metric's tag (`loss/<name>`)
PATH_SEPARATOR = "|"  # between the paths of one source (a comma separates sources)
SOURCES_EXAMPLE = "e.g. web=data/web/*.jsonl:0.7,code=builtin:0.3"
STAGES_EXAMPLE = "e.g. 8000:web=0.3,hq=0.7 (from step 8000 on); several joined by ';'"
_MIX_STREAM = 0x6D6978  # "mix": the draws' random stream, apart from every other use of data.seed


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    paths: str  # as data.corpus takes them: comma-separated (the config joins them with '|')
    weight: float


def _bad(key: str, text: str, why: str) -> UserError:
    return UserError(f"config.{key}={text!r} is not allowed: {why}")


def _weight(key: str, text: str, value: str, what: str) -> float:
    try:
        weight = float(value)
    except ValueError:
        raise _bad(key, text, f"{what}: the weight {value!r} is not a number") from None
    if not math.isfinite(weight) or weight < 0:
        raise _bad(key, text, f"{what}: the weight {value} is not a finite number of at least 0")
    return weight


def parse_sources(text: str, key: str = "data.sources") -> list[Source]:
    """The sources of `data.sources` (comma-separated `name=paths[:weight]`); one line for the first fault."""
    out: list[Source] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, eq, rest = entry.partition("=")
        name = name.strip()
        if not eq or not rest.strip():
            raise _bad(key, text, f"{entry!r} is not name=paths[:weight] ({SOURCES_EXAMPLE})")
        if not NAME.fullmatch(name):
            raise _bad(key, text, f"the source name {name!r} is not letters, digits, '_', '.' or '-'")
        if any(s.name == name for s in out):
            raise _bad(key, text, f"two sources are named {name!r}; give each its own name")
        paths, colon, value = rest.rpartition(":")
        if colon and _is_number(value):
            weight = _weight(key, text, value, f"source {name!r}")
        else:  # no weight (a path may hold ':')
            paths, weight = rest, 1.0
        paths = ",".join(p.strip() for p in paths.split(PATH_SEPARATOR) if p.strip())
        if not paths:
            raise _bad(key, text, f"source {name!r} names no path ({SOURCES_EXAMPLE})")
        out.append(Source(name, paths, weight))
    if text.strip() and not out:
        raise _bad(key, text, f"it names no source ({SOURCES_EXAMPLE})")
    if out and not sum(s.weight for s in out) > 0:
        raise _bad(key, text, "the weights sum to 0; give at least one source a positive weight")
    return out


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def parse_stages(text: str, names: Sequence[str], key: str = "data.stages") -> list[tuple[int, dict[str, float]]]:
    """(first step, weights by source name) of each stage of `data.stages`, in step order; a source a
    stage does not name weighs 0 in it. One line for the first fault."""
    stages: list[tuple[int, dict[str, float]]] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        step_text, colon, assignments = part.partition(":")
        try:
            step = int(step_text.strip())
        except ValueError:
            step = -1
        if not colon or step < 1:
            raise _bad(key, text, f"{part!r} is not step:name=weight,... with a step of at least 1 ({STAGES_EXAMPLE})")
        if stages and step <= stages[-1][0]:
            raise _bad(key, text, f"the stage at step {step} does not come after the one at step {stages[-1][0]}; "
                                  f"give the stages in increasing step order")
        weights: dict[str, float] = {}
        for item in (a.strip() for a in assignments.split(",")):
            if not item:
                continue
            name, eq, value = (x.strip() for x in item.partition("="))
            if not eq:
                raise _bad(key, text, f"stage {step}: {item!r} is not name=weight ({STAGES_EXAMPLE})")
            if name not in names:
                raise _bad(key, text, f"stage {step} names the source {name!r}, which data.sources does not "
                                      f"({', '.join(names) or 'none'})")
            weights[name] = _weight(key, text, value, f"stage {step}, source {name!r}")
        if not sum(weights.values()) > 0:
            raise _bad(key, text, f"the weights of the stage at step {step} sum to 0; give a source a positive weight")
        stages.append((step, weights))
    return stages


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Each step's weights: `base` from step 1, then each stage's from its step on. Training steps are
    counted from 1, as the run logs them; batch i (0-based) is step i + 1's."""

    names: tuple[str, ...]
    base: tuple[float, ...]
    stages: tuple[tuple[int, tuple[float, ...]], ...] = ()

    @classmethod
    def parse(cls, sources_text: str, stages_text: str = "") -> Schedule:
        sources = parse_sources(sources_text)
        names = tuple(s.name for s in sources)
        stages = parse_stages(stages_text, names)
        return cls(names, tuple(s.weight for s in sources),
                   tuple((step, tuple(w.get(n, 0.0) for n in names)) for step, w in stages))

    def raw(self, step: int) -> tuple[float, ...]:
        weights = self.base
        for first, stage in self.stages:
            if step >= first:
                weights = stage
        return weights

    def weights(self, step: int) -> np.ndarray:
        """Step `step`'s weights, summing to 1 [n_sources]."""
        raw = np.asarray(self.raw(step), np.float64)
        return raw / raw.sum()

    def shares(self, first: int, last: int) -> np.ndarray:
        """Σ over steps first..last of their weights: the batches' worth of rows each source gives [n_sources]."""
        total = np.zeros(len(self.names))
        bounds = [first] + [s for s, _ in self.stages if first < s <= last] + [last + 1]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi > lo:
                total += (hi - lo) * self.weights(lo)
        return total

    def describe(self) -> str:
        def one(weights: Sequence[float]) -> str:
            total = sum(weights)
            return ", ".join(f"{n} {w / total:.3g}" for n, w in zip(self.names, weights))

        return "; ".join([one(self.base)] + [f"from step {s:,}: {one(w)}" for s, w in self.stages])


def source_seed(seed: int, name: str) -> int:
    """The shuffling seed of source `name`: its own order, whatever the other sources and their order."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{name}".encode()).digest()[:4], "big")


def draw(weights: np.ndarray, seed: int, shard: int, step: int, rows: int) -> np.ndarray:
    """The source of each of a batch's `rows` rows (data shard `shard`, training step `step`): independent
    draws by `weights`, from uniform numbers fixed by (seed, shard, step). A source of weight 0 is never drawn."""
    uniform = np.random.default_rng([_MIX_STREAM, seed % 2**63, shard, step]).random(rows)
    edges = np.cumsum(weights)
    return np.minimum(np.searchsorted(edges, uniform * edges[-1], side="right"), len(weights) - 1)


def open_shard(docs: Mapping[str, Sequence], schedule: Schedule, *, seq_len: int, rows: int, seed: int, shard: int,
               shards: int, num_workers: int = 0, tok=None) -> streams.MixtureIterator:
    """Data shard `shard` of `shards` of a mixture: each source's documents (token arrays, `FlatDocuments`, or
    texts tokenized on the fly with `tok`) sliced and packed into `rows` bins, its own `num_workers` workers."""
    opened: dict[str, grain.DatasetIterator] = {}
    try:
        for name in schedule.names:
            stream = pipeline.make_row_stream(docs[name], seq_len=seq_len, bins=rows, seed=source_seed(seed, name),
                                              shard_index=shard, shard_count=shards, num_workers=num_workers, tok=tok)
            opened[name] = iter(stream)
        return streams.MixtureIterator(opened, schedule, rows, seed, shard)
    except BaseException:
        for stream in opened.values():
            stream.close()
        raise


@dataclasses.dataclass(frozen=True)
class SourceFacts:
    """What the start-of-run report says of a source."""

    name: str
    paths: str
    documents: int
    tokens: int | None  # None: tokenized on the fly (unknown until read)


@dataclasses.dataclass(frozen=True)
class Mixture:
    """A loaded mixture: its sources' facts and the weights' schedule (`loader.Data.mixture`)."""

    sources: tuple[SourceFacts, ...]
    schedule: Schedule

    @property
    def names(self) -> tuple[str, ...]:
        return self.schedule.names

    def report(self, first_step: int, last_step: int, tokens_per_step: int) -> str:
        """Each source's documents, tokens, weights and the tokens and epochs steps first..last draw from it
        (rows of seq_len tokens: packing's padding, a few percent, counts as drawn)."""
        drawn = self.schedule.shares(first_step, last_step) * tokens_per_step
        rows = []
        for facts, tokens in zip(self.sources, drawn):
            weights = self._weights_of(facts.name)
            rows.append([facts.name, facts.paths, facts.documents,
                         "n/a (on the fly)" if facts.tokens is None else facts.tokens,
                         " -> ".join(f"{w:.3g}" for w in weights) if len(set(weights)) > 1 else f"{weights[0]:.3g}",
                         int(round(tokens)), f"{tokens / facts.tokens:.3g}" if facts.tokens else "n/a"])
        table = Table(["source", "paths", "documents", "tokens", "weight", "tokens drawn", "epochs"], rows)
        return (f"data mixture of {len(self.sources)} sources, steps {first_step:,}-{last_step:,} "
                f"(weights: {self.schedule.describe()}):\n{table}")

    def _weights_of(self, name: str) -> list[float]:
        """The source's share at step 1 and in each stage."""
        i = self.names.index(name)
        return [self.schedule.weights(1)[i]] + [self.schedule.weights(s)[i] for s, _ in self.schedule.stages]


def same_sources(old: str, new: str) -> bool:
    """Whether two `data.sources` name the same sources with the same paths (their weights may differ): what a
    resumed run may change."""
    def key(text: str) -> list[tuple[str, str]] | None:
        try:
            return [(s.name, s.paths) for s in parse_sources(text)]
        except UserError:
            return None

    return key(old) is not None and key(old) == key(new)
