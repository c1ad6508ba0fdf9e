"""Sudoku as a sequence task: a seeded puzzle generator, a fixed tokenizer, the sequence layout and scoring.

Why Sudoku: the answer is not naturally written left to right (a cell is often forced only by cells that
come after it), which is where a diffusion decoder that fills a whole canvas at once is claimed to beat
an autoregressive one (Ye et al. 2024, arXiv 2410.14157; Kim et al. 2025, arXiv 2502.06768).

Layout (one training document, one held-out example): ``<bos> puzzle(81) solution(81) <eos>`` = 164
tokens, one token per cell, ``0`` for an empty cell. With ``canvas_length = 82`` that is exactly two
canvases: the first is ``<bos>`` + the puzzle (the prompt at evaluation), the second is the solution +
``<eos>``, which the diffusion decoder denoises in one canvas given the puzzle through the cache, and
which the AR model writes token by token from the same prompt. Both models see the same tokens.

The vocabulary is fixed (13 tokens: ``<pad> <eos> <bos>`` at ids 0, 1, 2 as the model config expects,
then the characters ``0``..``9``) instead of a trained BPE: BPE would merge digit runs into multi-cell
tokens and break the cell-to-token alignment, and uniform-state noise over a 13-token vocabulary draws
mostly digits, so the decoder must learn which digits are wrong rather than spot out-of-alphabet junk.

Puzzles: a random full grid (randomised backtracking), then cells are removed in a random order, each
removal kept only if the puzzle still has exactly one solution (a bitmask solver that counts up to two),
until the target number of givens is reached. Fewer givens is harder. Puzzle ``i`` of a seed depends
only on ``(seed, i)``, so any slice of a dataset can be regenerated alone.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from printpress.errors import PrintpressError

CELLS = 81
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
DIGIT_BASE = 3  # id of the character "0"; "d" has id DIGIT_BASE + d
VOCAB = ("<pad>", "<eos>", "<bos>", *"0123456789")
VOCAB_SIZE = len(VOCAB)
CANVAS_LENGTH = 1 + CELLS  # <bos> + puzzle = one canvas; solution + <eos> = the next
SEQ_LEN = 2 * CANVAS_LENGTH
_ALL = 0b1111111110  # bits 1..9: the candidate digits


class SudokuError(PrintpressError):
    """A grid, puzzle or generator setting that is not valid."""


# -- grid geometry -----------------------------------------------------------------------------------------

_ROW = [i // 9 for i in range(CELLS)]
_COL = [i % 9 for i in range(CELLS)]
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(CELLS)]


def _check_grid(grid: Sequence[int], what: str = "grid") -> list[int]:
    cells = list(grid)
    if len(cells) != CELLS:
        raise SudokuError(f"a {what} has {CELLS} cells, got {len(cells)}")
    for i, v in enumerate(cells):
        if not isinstance(v, int) or not 0 <= v <= 9:
            raise SudokuError(f"{what} cell {i} is {v!r}; cells are digits 0-9 (0 = empty)")
    return cells


def parse(text: str) -> list[int]:
    """81 characters ``0``-``9`` (``.`` is also read as an empty cell) -> a list of cells."""
    text = text.strip().replace(".", "0")
    if len(text) != CELLS or not text.isdigit() or not text.isascii():
        raise SudokuError(f"a Sudoku string has {CELLS} characters 0-9 or '.', got {text[:90]!r}")
    return [int(c) for c in text]


def to_string(grid: Sequence[int]) -> str:
    return "".join(str(v) for v in _check_grid(grid))


# -- solver ------------------------------------------------------------------------------------------------


def solve(puzzle: Sequence[int], limit: int = 2, rng: random.Random | None = None) -> list[list[int]]:
    """Up to `limit` solutions of `puzzle` (empty list: none). With `rng`, digits are tried in a random
    order, which is how a random full grid is drawn from the empty puzzle."""
    cells = _check_grid(puzzle, "puzzle")
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    empties = []
    for i, v in enumerate(cells):
        if v == 0:
            empties.append(i)
            continue
        bit = 1 << v
        if rows[_ROW[i]] & bit or cols[_COL[i]] & bit or boxes[_BOX[i]] & bit:
            return []  # the givens already clash
        rows[_ROW[i]] |= bit
        cols[_COL[i]] |= bit
        boxes[_BOX[i]] |= bit
    found: list[list[int]] = []

    def search() -> None:
        # Most-constrained cell first: with unique puzzles this is mostly forced moves, no branching.
        best, best_mask, best_count = -1, 0, 10
        for k, i in enumerate(empties):
            if cells[i]:
                continue
            mask = _ALL & ~(rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]])
            count = mask.bit_count()
            if count < best_count:
                best, best_mask, best_count = i, mask, count
                if count <= 1:
                    break
        if best < 0:
            found.append(cells.copy())
            return
        if best_count == 0:
            return
        digits = [d for d in range(1, 10) if best_mask >> d & 1]
        if rng is not None:
            rng.shuffle(digits)
        r, c, b = _ROW[best], _COL[best], _BOX[best]
        for d in digits:
            bit = 1 << d
            cells[best] = d
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            search()
            rows[r] &= ~bit
            cols[c] &= ~bit
            boxes[b] &= ~bit
            cells[best] = 0
            if len(found) >= limit:
                return

    search()
    return found


def count_solutions(puzzle: Sequence[int], limit: int = 2) -> int:
    return len(solve(puzzle, limit))


# -- generator ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    puzzle: list[int]
    solution: list[int]

    @property
    def givens(self) -> int:
        return sum(1 for v in self.puzzle if v)


def random_grid(rng: random.Random) -> list[int]:
    return solve([0] * CELLS, limit=1, rng=rng)[0]


def make_puzzle(rng: random.Random, givens: int, max_tries: int = 50) -> Example:
    """A puzzle with exactly `givens` givens and a unique solution."""
    if not 17 <= givens <= CELLS:
        raise SudokuError(f"givens must be between 17 and {CELLS}, got {givens}")
    for _ in range(max_tries):
        solution = random_grid(rng)
        puzzle = solution.copy()
        order = list(range(CELLS))
        rng.shuffle(order)
        left = CELLS
        for i in order:
            if left == givens:
                break
            puzzle[i] = 0
            if count_solutions(puzzle) == 1:
                left -= 1
            else:
                puzzle[i] = solution[i]
        if left == givens:
            return Example(puzzle, solution)
    raise SudokuError(f"could not reach {givens} givens in {max_tries} grids; ask for more givens")


def example(seed: int | str, index: int, givens: tuple[int, int]) -> Example:
    """Puzzle `index` of the set `seed`: the number of givens is drawn uniformly from the closed range."""
    lo, hi = givens
    if lo > hi:
        raise SudokuError(f"givens range ({lo}, {hi}) is empty")
    rng = random.Random(f"printpress.sudoku:{seed}:{index}")
    return make_puzzle(rng, rng.randint(lo, hi))


def generate(n: int, seed: int | str, givens: tuple[int, int]) -> list[Example]:
    return [example(seed, i, givens) for i in range(n)]


# -- tokens ------------------------------------------------------------------------------------------------


def cells_to_ids(grid: Sequence[int]) -> list[int]:
    return [DIGIT_BASE + v for v in _check_grid(grid)]


def ids_to_cells(ids: Sequence[int]) -> list[int]:
    """Token ids -> cells; a non-digit token (pad, eos, bos) becomes -1, an invalid cell."""
    return [int(t) - DIGIT_BASE if DIGIT_BASE <= int(t) < DIGIT_BASE + 10 else -1 for t in ids]


def prompt_ids(puzzle: Sequence[int]) -> list[int]:
    """The first canvas: ``<bos>`` + the puzzle (what both models are given)."""
    return [BOS_ID, *cells_to_ids(puzzle)]


def sequence_ids(ex: Example) -> list[int]:
    """The whole training sequence: prompt, solution, ``<eos>`` (SEQ_LEN tokens, two canvases)."""
    return [*prompt_ids(ex.puzzle), *cells_to_ids(ex.solution), EOS_ID]


def document_text(ex: Example) -> str:
    """The text the data pipeline tokenises (it adds ``<bos>``/``<eos>`` itself): puzzle then solution."""
    return to_string(ex.puzzle) + to_string(ex.solution)


def tokenizer():
    """The fixed tokenizer as a `tokenizers.Tokenizer` (one token per character, no merges), so model
    folders, the data pipeline and the engine handle Sudoku like any other checkpoint."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.add_special_tokens(list(VOCAB[:3]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


# -- scoring -----------------------------------------------------------------------------------------------


def is_valid_solution(grid: Sequence[int]) -> bool:
    """Every row, column and box holds 1..9 exactly once (any cell outside 1..9 fails)."""
    cells = list(grid)
    if len(cells) != CELLS or any(not 1 <= v <= 9 for v in cells):
        return False
    for unit in (_ROW, _COL, _BOX):
        seen = [0] * 9
        for i, v in enumerate(cells):
            seen[unit[i]] |= 1 << v
        if any(mask != _ALL for mask in seen):
            return False
    return True


def keeps_givens(puzzle: Sequence[int], grid: Sequence[int]) -> bool:
    return all(p == 0 or p == g for p, g in zip(puzzle, grid))


@dataclass(frozen=True)
class Score:
    solved: bool  # all 81 cells equal the (unique) solution
    valid: bool  # a valid Sudoku grid that keeps the givens (equals `solved` for unique puzzles)
    cells_right: int  # cells equal to the solution, of 81
    blanks_right: int  # of those, cells that were empty in the puzzle
    blanks: int


def score(puzzle: Sequence[int], solution: Sequence[int], predicted: Sequence[int]) -> Score:
    """Score a predicted grid (cells; -1 or short = wrong) against the puzzle's unique solution."""
    pred = list(predicted)[:CELLS]
    pred += [-1] * (CELLS - len(pred))
    right = [p == s for p, s in zip(pred, solution)]
    blanks = [i for i, v in enumerate(puzzle) if v == 0]
    valid = is_valid_solution(pred) and keeps_givens(puzzle, pred)
    return Score(
        solved=all(right),
        valid=valid,
        cells_right=sum(right),
        blanks_right=sum(right[i] for i in blanks),
        blanks=len(blanks),
    )


def format_grid(grid: Iterable[int]) -> str:
    """A 9-line picture of a grid (``.`` for empty, ``?`` for a non-digit), for reports and samples."""
    cells = ["." if v == 0 else "?" if not 1 <= v <= 9 else str(v) for v in grid]
    return "\n".join(" ".join(cells[r * 9 : r * 9 + 9]) for r in range(9))


# -- the training corpus -----------------------------------------------------------------------------------

# The built-in "sudoku" corpus (`printpress.corpora.sudoku_documents`) is puzzles of this generator:
CORPUS_SIZE = 20_000  # training puzzles of the built-in "sudoku" corpus (more than the recipes consume)
CORPUS_SEED = "train"  # held-out sets use other seeds (printpress.eval.sudoku)
CORPUS_GIVENS = (28, 40)
CORPUS_VERSION = 1  # bump when the generator changes, so old cached files are not reused
