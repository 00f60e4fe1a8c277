"""How a user's reward function is called: its calling convention, detected once from its signature.

A reward function loaded by path is wrapped in a :class:`UserReward` that knows how to call it and shows the
rest of megarl the one contract of :class:`~megarl.rewards.base.RewardFunction`, ``(prompt, response, row)``;
nothing else branches on the convention. Three conventions, because users bring functions written for megarl
and for TRL:

- ``row``: ``fn(prompt, response, row)``, the dataset row's other columns as one mapping. megarl's own and
  its built-ins' convention; every function written for it before keeps working.
- ``keywords``: ``fn(prompt=..., response=..., **columns)``, each column a keyword argument, as TRL passes
  them. ``completion`` is accepted as another name for ``response``. A parameter without a default is a
  column the dataset must have; a function without ``**kwargs`` gets only the columns it names.
- ``batch``: ``fn(prompts=[...], completions=[...], **{column: [values]}) -> list[float]``, TRL's
  ``reward_funcs`` as they are written, called once per batch (a :class:`BatchUserReward`). Supported as
  such, not one sample at a time, because TRL users write exactly this and their functions may rely on
  the batch (one batched model call, a score relative to the other completions); a batch call that fails
  is a failure of every sample in it. A column some rows lack is ``None`` in theirs.

Detection, first rule that applies (so every signature has exactly one reading):

1. a parameter named ``prompts`` or ``completions``: batch;
2. a parameter named ``row``, a third positional parameter without a default, or ``*args``: row (called
   positionally);
3. a parameter named ``response`` or ``completion``, or ``**kwargs``: keywords;
4. anything else is a :class:`ConfigError` that shows the three forms.

So ``def f(prompt, response, target=None, **_)`` is keyword style and gets the column ``target``, not the
whole row. ``def f(prompt, response, target)`` stays row style; :meth:`UserReward.check_columns` refuses it
when the dataset has a column ``target``. Under the keyword and batch conventions the columns ``prompt``,
``response``, ``completion``, ``prompts`` and ``completions`` are not passed (TRL drops ``prompt`` and
``completion`` likewise): those names are taken. Prompts are text (for a chat prompt, its last user message)
and completions are text, never message lists. Pure module: standard library only.
"""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from megarl.errors import ConfigError

logger = logging.getLogger(__name__)


class Convention(enum.Enum):
    ROW = "row"  # fn(prompt, response, row)
    KEYWORDS = "keywords"  # fn(prompt=..., response=..., **columns)
    BATCH = "batch"  # fn(prompts=[...], completions=[...], **{column: [...]}) -> list[float]


FORMS = ("one of: (prompt, response, row) with the row's columns as one mapping, e.g. "
         "'def score(prompt, response, row)'; keyword arguments naming 'response' (or 'completion') and the "
         "columns read, e.g. 'def score(prompt, response, target=None, **kwargs)'; or TRL's batch form, e.g. "
         "'def score(prompts, completions, **kwargs) -> list[float]'")
TAKEN = frozenset({"prompt", "response", "completion", "prompts", "completions"})  # never passed as columns
# what TRL passes besides the columns and megarl has nothing to pass for: accepted with a default only
TRL_ONLY = frozenset({"completion_ids", "trainer_state", "log_extra", "log_metric", "environments"})
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class UserReward:
    """A user function and how to call it; called as megarl's ``(prompt, response, row)``.

    ``reads``: the columns it names (keyword and batch style); ``takes``: the columns passed (``reads``, or
    None: all of them, the function has ``**kwargs``); ``required``: the columns without a default;
    ``row_param``: row style, the parameter the row lands in (None under ``*args``); ``response_name``:
    ``response``, ``completion`` (keyword style) or ``completions`` (batch style)."""

    def __init__(self, fn: Callable[..., Any], spec: str, convention: Convention, signature: str, *,
                 reads: frozenset[str] = frozenset(), takes: frozenset[str] | None = None,
                 required: frozenset[str] = frozenset(), row_param: str | None = None,
                 response_name: str = "response", passes_prompt: bool = True) -> None:
        self.fn, self.spec, self.convention, self.signature = fn, spec, convention, signature
        self.reads, self.takes, self.required, self.row_param = reads, takes, required, row_param
        self.response_name, self.passes_prompt = response_name, passes_prompt
        self.__wrapped__ = fn  # describe() and error messages name the user's function

    def __call__(self, prompt: str, response: str, row: Mapping[str, Any]) -> Any:
        if self.convention is Convention.ROW:
            return self.fn(prompt, response, row)
        keywords = {self.response_name: response, **({"prompt": prompt} if self.passes_prompt else {})}
        keywords |= {k: v for k, v in row.items() if self._passed(k)}
        missing = sorted(self.required - keywords.keys())
        if missing:
            raise LookupError(f"{self.name} needs the column(s) {missing}, which this row lacks; its columns: "
                              f"{sorted(row)}")
        return self.fn(**keywords)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", None) or type(self.fn).__name__

    def _passed(self, column: object) -> bool:
        return isinstance(column, str) and column not in TAKEN and (self.takes is None or column in self.takes)

    def call_text(self) -> str:
        """How it is called, for messages: e.g. ``score(prompt=..., response=..., **columns) (keyword style)``."""
        form = {Convention.ROW: "(prompt, response, row) with the row as one mapping",
                Convention.KEYWORDS: f"(prompt=..., {self.response_name}=..., **columns) with each column a keyword",
                Convention.BATCH: "(prompts=[...], completions=[...], **{column: [...]}) once per batch"}
        return f"{self.name}{form[self.convention]} ({self.convention.value} style, by its signature {self.signature})"

    def check_columns(self, columns: Collection[str]) -> list[str]:
        """Raise a :class:`ConfigError` if rows with ``columns`` cannot be scored as intended (a required column
        missing; a row-style third parameter named like a column); return warnings (a parameter with a default
        that names no column, so it always gets its default)."""
        where = f"reward function {self.spec!r} {self.signature}"
        if self.convention is Convention.ROW:
            if self.row_param not in (None, "row") and self.row_param in columns:
                raise ConfigError(
                    f"{where}: its third parameter {self.row_param!r} receives the whole row (a mapping of every "
                    f"column: {sorted(columns)}) under megarl's row convention, but the dataset also has a column "
                    f"{self.row_param!r}, which it probably means. Rename the parameter to 'row' and read "
                    f"row[{self.row_param!r}], or take the column as a keyword: give it a default "
                    f"('{self.row_param}=None') or make it keyword-only ('*, {self.row_param}')")
            return []
        missing = sorted(self.required - set(columns))
        if missing:
            raise ConfigError(
                f"{where} is called {self.convention.value} style and needs the column(s) {missing} (parameters "
                f"without a default), but the dataset's rows have only {sorted(columns)}. Rename the parameter to a "
                "column's name, give it a default, or add the column (e.g. with data.row_adapter)")
        unmatched = sorted(self.reads - set(columns) - TRL_ONLY)
        if unmatched:
            return [f"{where}: the parameter(s) {unmatched} name no column of the dataset ({sorted(columns)}) and "
                    "always get their defaults; rename them to the columns they mean"]
        return []


class BatchUserReward(UserReward):
    """TRL's batch style: :meth:`score_batch` calls the function once for a batch (``score_samples`` uses it)."""

    def __call__(self, prompt: str, response: str, row: Mapping[str, Any]) -> Any:
        return self.score_batch([prompt], [response], [row])[0]  # one sample (e.g. a WeightedReward term)

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str],
                    rows: Sequence[Mapping[str, Any]]) -> list[Any]:
        """One value per sample, as the function returned them (checked for count, not for type)."""
        keywords: dict[str, Any] = {"completions": list(responses)}
        if self.passes_prompt:
            keywords["prompts"] = list(prompts)
        columns = dict.fromkeys(k for row in rows for k in row if self._passed(k))  # first-seen order
        keywords |= {c: [row.get(c) for row in rows] for c in columns}
        missing = sorted(self.required - keywords.keys())
        if missing:
            raise LookupError(f"{self.name} needs the column(s) {missing}, which no row of this batch has; their "
                              f"columns: {list(columns)}")
        values = self.fn(**keywords)
        if isinstance(values, str | bytes | Mapping):
            values = None  # iterable, but not one score per completion
        try:
            scores = list(values)
        except TypeError:
            raise TypeError(f"{self.name} returned {values!r} ({type(values).__name__}); a batch-style reward "
                            f"function returns one score per completion, a list of {len(responses)} numbers") from None
        if len(scores) != len(responses):
            raise ValueError(f"{self.name} returned {len(scores)} scores for {len(responses)} completions; a "
                             "batch-style reward function returns one score per completion, in order")
        return scores


def adapt(fn: Callable[..., Any], spec: str) -> UserReward:
    """Wrap ``fn`` (loaded from ``spec``) for its calling convention; a ConfigError if it fits none."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C extensions have none: megarl's own call
        return UserReward(fn, spec, Convention.ROW, "(unknown)")
    params = list(signature.parameters.values())
    named = {p.name: p for p in params if p.kind not in _VARIADIC}
    positional = [p for p in params if p.kind in _POSITIONAL]
    var_args = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    var_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if "prompts" in named or "completions" in named:
        adapted = _keywords(fn, spec, signature, named, var_kwargs, Convention.BATCH)
    elif "row" in named or var_args or (len(positional) >= 3 and positional[2].default is inspect.Parameter.empty):
        adapted = _row(fn, spec, signature)
    elif "response" in named or "completion" in named or var_kwargs:
        adapted = _keywords(fn, spec, signature, named, var_kwargs, Convention.KEYWORDS)
    else:
        raise ConfigError(f"reward function {spec!r} has the signature {signature}, which fits no calling convention "
                          f"(it names no 'row', 'response', 'completion', 'completions' and has no third positional "
                          f"parameter); expected {FORMS}. Rename its parameters to one of these forms")
    logger.info("reward function %s is called as %s", spec, adapted.call_text())
    return adapted


def _row(fn: Callable[..., Any], spec: str, signature: inspect.Signature) -> UserReward:
    row = object()
    try:
        bound = signature.bind("prompt", "response", row)
    except TypeError as e:
        raise ConfigError(f"reward function {spec!r} has the signature {signature}, read as megarl's row convention "
                          f"(a parameter 'row', a third positional parameter or *args), which cannot be called as "
                          f"(prompt, response, row): {e}. Expected {FORMS}") from None
    row_param = next((k for k, v in bound.arguments.items() if v is row), None)  # None: in *args
    if "row" in signature.parameters and row_param != "row":
        raise ConfigError(f"reward function {spec!r} has the signature {signature}: its parameter 'row' is not the "
                          f"third positional one, where megarl passes the row ({row_param!r} gets it). Make it "
                          "'(prompt, response, row)'")
    return UserReward(fn, spec, Convention.ROW, str(signature), row_param=row_param)


def _keywords(fn: Callable[..., Any], spec: str, signature: inspect.Signature, named: dict[str, inspect.Parameter],
              var_kwargs: bool, convention: Convention) -> UserReward:
    """The keyword-style conventions: ``columns`` (one sample) and ``batch``; every argument passed by name."""
    batch = convention is Convention.BATCH
    prompt_name, response_names = ("prompts", ("completions",)) if batch else ("prompt", ("response", "completion"))
    where = f"reward function {spec!r} has the signature {signature}, read as {convention.value} style"
    response = [n for n in response_names if n in named] or ([response_names[0]] if var_kwargs else [])
    if len(response) != 1:
        found = "both 'response' and 'completion'" if response else f"no '{response_names[0]}' and no **kwargs"
        raise ConfigError(f"{where}; it takes {found}, so megarl cannot tell where the response goes. Expected {FORMS}")
    problems = [f"{n!r} is positional-only" for n, p in named.items() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    required = frozenset(n for n, p in named.items() if p.default is inspect.Parameter.empty) - {prompt_name, *response}
    problems += [f"{n!r} is required but megarl never passes it" for n in sorted(required & (TAKEN | TRL_ONLY))]
    if problems:
        raise ConfigError(f"{where} (every argument passed by name: {prompt_name}, {response[0]} and the columns); "
                          f"{'; '.join(problems)}. Give such parameters a default or remove them; expected {FORMS}")
    reads = frozenset(named) - TAKEN
    adapter = BatchUserReward if batch else UserReward
    return adapter(fn, spec, convention, str(signature), reads=reads, takes=None if var_kwargs else reads,
                   required=required, response_name=response[0], passes_prompt=var_kwargs or prompt_name in named)
