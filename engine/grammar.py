"""Structured output: a request's grammar, compiled once, and the matcher that masks its rows.

    GrammarSpec          plain data in SamplingParams: what the output must match (a JSON
                         schema, any JSON object, a regex, one of some strings, an EBNF grammar)
    GrammarCompiler      spec -> compiled grammar (xgrammar), cached by spec; ValueError naming
                         what does not compile (the serving edge compiles before admitting, off
                         the engine thread, so the engine only ever finds it in the cache)
    GrammarManager       one matcher per constrained request, keyed by request id: the token
                         masks of a step's rows, speculative advances over drafts, rollback

Masks with MTP (one request, drafts d0..dK-1, see speculative.py's row table):

    matcher state   s0 --d0--> s1 --d1--> ... --dK-1--> sK       (then rolled back to s0)
    verify row      0          1                        K
    row mask        mask(s0)   mask(s1)                 mask(sK)

so row j allows exactly what plain decoding would allow after the drafts before it; greedy is
token-identical with MTP on or off. After the commit the matcher advances over the emitted
tokens only (the accepted drafts and the token chosen at the first rejection). A draft the
grammar forbids ends the state chain there: its own row forbids it (so it is rejected) and the
rows after it are never used. Requests without a grammar never reach this module.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 65536       # a longer schema, regex or grammar is refused before compiling
MAX_CACHED_GRAMMARS = 128       # compiled grammars kept (one holds token-mask caches: MBs for a large vocabulary)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. kind: json_schema (value: the schema as JSON text),
    json_object (any JSON object; value ""), regex, choice (value: a JSON list of strings),
    grammar (EBNF as xgrammar and vLLM's guided_grammar take it). param: the request field it
    came from, named in errors."""
    kind: str
    value: str
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"{self.param}: the grammar must be text, got {type(self.value).__name__}")
        if len(self.value) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{self.param} is {len(self.value)} characters, more than the {MAX_GRAMMAR_CHARS} "
                             f"this server compiles")


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's error without its C++ source location ("[17:03:07] /project/cpp/x.cc:94: ")."""
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(e).strip()).strip() or type(e).__name__


NOT_INSTALLED = ("structured output needs xgrammar, which this server's install lacks "
                 "(pip install 'mtpserve[structured]')")


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer (xgrammar), thread-safe, cached by spec.

    The tokenizer's special tokens (``<|im_start|>``, ``<tool_call>``, ...) are never text to the
    grammar: only the stop ids may end a constrained output, once the grammar is complete."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self._tokenizer_json, self.vocab_size, self.stop_token_ids = tokenizer_json, vocab_size, stop_token_ids
        self._lock = threading.Lock()
        self._compiler = None
        self._cache: dict[GrammarSpec, object] = {}

    @staticmethod
    def available() -> bool:
        """Whether xgrammar is installed (the ``structured`` extra)."""
        import importlib.util
        return importlib.util.find_spec("xgrammar") is not None

    def preload(self) -> bool:
        """``load`` at a server's start when xgrammar is installed; False (nothing loaded) if not."""
        if not self.available():
            return False
        self.load()
        return True

    def load(self):
        """Load xgrammar (it imports torch: seconds) and index the vocabulary, once; a server calls
        it at start, so that neither the first constrained request nor the engine thread (the
        import holds the GIL) pays it mid-traffic. Returns xgrammar's compiler; ValueError if
        xgrammar is not installed (a request asking for structured output then gets a 400)."""
        with self._lock:
            if self._compiler is None:      # xgrammar (and torch) load on the first grammar only
                if not self.available():
                    raise ValueError(NOT_INSTALLED)
                import xgrammar as xgr
                from tokenizers import Tokenizer
                tok = Tokenizer.from_file(str(self._tokenizer_json))
                encoded = [""] * self.vocab_size
                for piece, i in tok.get_vocab(with_added_tokens=True).items():
                    if i < self.vocab_size:
                        encoded[i] = piece
                for i, added in tok.get_added_tokens_decoder().items():
                    if added.special and i < self.vocab_size:
                        encoded[i] = ""     # xgrammar's mark of a special token: never matched as text
                info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab_size,
                                         stop_token_ids=list(self.stop_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of ``spec`` (cached); ValueError naming spec.param if it does not compile."""
        hit = self._cache.get(spec)
        if hit is not None:
            return hit
        compiler = self.load()
        try:
            if spec.kind == "json_schema":
                compiled = compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
            elif spec.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value)
            elif spec.kind == "choice":
                choices = json.loads(spec.value)
                compiled = compiler.compile_regex("|".join(f"({re.escape(c)})" for c in choices))
            else:
                compiled = compiler.compile_grammar(spec.value)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for bad input
            raise ValueError(f"{spec.param} does not compile: {_xgrammar_message(e)}") from None
        with self._lock:
            if len(self._cache) >= MAX_CACHED_GRAMMARS:       # oldest out first
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = compiled
        return compiled


class GrammarManager:
    """Each constrained request's matcher (xgrammar), keyed by request id; see the module docstring.

    Masks are filled as xgrammar's int32 bitmasks (one row per logits row, all of a step's rows
    in one array) and unpacked once to bool [rows, vocab] (True = allowed), which the engine
    applies to its logits rows. ``check_integrity``-style bookkeeping: ``request_ids`` must stay within the
    engine's live requests."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._matchers: dict[str, object] = {}
        self._speculated: dict[str, int] = {}        # drafts advanced over since the last rollback
        self._blocked: set[str] = set()               # met a draft the grammar forbids since then

    def start(self, request_id: str, spec: GrammarSpec) -> None:
        import xgrammar as xgr
        self._matchers[request_id] = xgr.GrammarMatcher(self.compiler.compile(spec))
        self._speculated[request_id] = 0

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._speculated.pop(request_id, None)
        self._blocked.discard(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __bool__(self) -> bool:
        return bool(self._matchers)

    @property
    def request_ids(self) -> set[str]:
        return set(self._matchers)

    def bitmask(self, num_rows: int) -> np.ndarray:
        """An int32 bitmask [num_rows, ceil(V / 32)] to fill (bit t of a row: token t allowed)."""
        return np.empty((num_rows, (self.compiler.vocab_size + 31) // 32), np.int32)

    def allowed(self, bitmask: np.ndarray) -> np.ndarray:
        """bool [rows, V] of a filled bitmask, on the host (a GPU applies the words themselves:
        ``mask_rows``)."""
        return np.unpackbits(bitmask.view(np.uint8), axis=1, count=self.compiler.vocab_size,
                             bitorder="little").view(bool)

    def mask_rows(self, logits, rows, bitmask: np.ndarray, xp=None) -> None:
        """In place: ``logits[rows[i]]`` at -inf wherever bitmask row i forbids the token. On a
        GPU the row indices and bitmask words go over in one copy and one kernel applies them."""
        if xp is None or xp is np:
            idx = np.asarray(rows, np.int64)
            logits[idx] = np.where(self.allowed(bitmask), logits[idx], -np.inf)
            return
        from mtpserve.engine.cuda_kernels import mask_rows_by_bitmask
        packed = np.concatenate([np.asarray(rows, np.int32), bitmask.reshape(-1)])
        mask_rows_by_bitmask(logits, xp.asarray(packed), len(rows), bitmask.shape[1])

    def _fill(self, matcher, bitmask: np.ndarray, row: int) -> None:
        if matcher.is_terminated():            # nothing may follow the end: only a stop id (again)
            bits = bitmask.view(np.uint32)
            bits[row] = 0
            for t in self.compiler.stop_token_ids:
                bits[row, t >> 5] |= np.uint32(1 << (t & 31))
        else:
            matcher.fill_next_token_bitmask(bitmask, row)

    def fill_mask(self, request_id: str, bitmask: np.ndarray, row: int) -> None:
        """Row ``row`` of ``bitmask``: the tokens allowed next, after the committed output and
        any drafts speculated."""
        self._fill(self._matchers[request_id], bitmask, row)

    def mask(self, request_id: str) -> np.ndarray:
        """[V] bool: the tokens allowed next (``fill_mask`` of one row, unpacked)."""
        bitmask = self.bitmask(1)
        self.fill_mask(request_id, bitmask, 0)
        return self.allowed(bitmask)[0]

    def speculate(self, request_id: str, token: int) -> bool:
        """Advance over a draft (undone by ``rollback``); False: the grammar forbids it (or the
        grammar has ended), and no later draft is advanced over until the rollback."""
        m = self._matchers[request_id]
        if request_id in self._blocked or m.is_terminated() or not m.accept_token(int(token)):
            self._blocked.add(request_id)
            return False
        self._speculated[request_id] += 1
        return True

    def rollback(self, request_id: str) -> None:
        """Undo every ``speculate`` since the last rollback."""
        if self._speculated[request_id]:
            self._matchers[request_id].rollback(self._speculated[request_id])
        self._speculated[request_id] = 0
        self._blocked.discard(request_id)

    def fill_row_masks(self, request_id: str, drafts: list[int], bitmask: np.ndarray, start: int) -> None:
        """Rows ``start .. start + len(drafts)`` of ``bitmask``: the masks of a request's verify
        rows (row j: after drafts 0..j-1; rows after a forbidden draft allow everything, they are
        never used). The matcher is back where it was on return."""
        m = self._matchers[request_id]
        assert self._speculated[request_id] == 0, f"{request_id}: drafts speculated and not rolled back"
        bitmask[start:start + len(drafts) + 1] = -1
        for j in range(len(drafts) + 1):
            self._fill(m, bitmask, start + j)
            if j == len(drafts) or not self.speculate(request_id, drafts[j]):
                break
        self.rollback(request_id)

    def row_masks(self, request_id: str, drafts: list[int]) -> np.ndarray:
        """[len(drafts) + 1, V] bool: ``fill_row_masks`` unpacked."""
        bitmask = self.bitmask(len(drafts) + 1)
        self.fill_row_masks(request_id, drafts, bitmask, 0)
        return self.allowed(bitmask)

    def advance(self, request_id: str, tokens: list[int]) -> None:
        """Commit emitted tokens (each was chosen from a masked row, so the grammar takes it)."""
        m = self._matchers[request_id]
        for t in tokens:
            if m.is_terminated():
                break
            accepted = m.accept_token(int(t))
            assert accepted, f"{request_id}: emitted token {t} that its grammar forbids"
