"""``daedalus maze``: generate one maze, write its picture, print its map and shortest solution.

Example::

    daedalus maze --size 9 --seed 3 --out maze.png
    python -m daedalus_trainer.envs.maze_cli --size 9 --seed 3 --out maze.png

The maze is ``maze_from_seed(size, seed)``, the same one ``Maze2DEnv(size).reset(seed=seed)`` starts with.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from PIL import Image

from .actions import ACTION_FORMATS, STOP, format_action
from .maze import maze_from_seed, render_ascii, render_rgb, solve


def run(size: int, seed: int, out: str | None, cell_px: int = 25, action_format: str = "function") -> int:
    """Generate ``maze_from_seed(size, seed)``; print it and its solution; write a PNG when ``out`` is given.

    Prints to stdout: a summary line (size, seed, layout hash, start, goal, shortest path length), the
    text map (:func:`~daedalus_trainer.envs.maze.render_ascii`, agent on the start), then the shortest
    solution in ``action_format``, one action per line, ending with stop (the VisGym success rule).

    Args:
        size: odd, >= 5, walls included.
        seed: generator seed (any non-negative int).
        out: image path (parent folders are created), or None for no picture: PNG, or the format its extension
            names (``.jpg``, ``.gif``, ...; one Pillow cannot write is refused).
        cell_px: pixels per cell (>= 4).
        action_format: ``function``, ``tuple`` or ``tag``.

    Returns:
        0 on success; 2 for invalid arguments or an ``out`` that cannot be written (the reason goes to stderr, one
        line; an ``out`` that is a directory or lies under a file is refused before anything is printed).
    """
    from daedalus_trainer.usage import UsageError, make_dir

    try:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        maze = maze_from_seed(size, seed)
        image = render_rgb(maze, maze.start, cell_px)
        moves = solve(maze)
        lines = [format_action(move, action_format) for move in moves] + [format_action(STOP, action_format)]
    except ValueError as err:
        # the library names its parameters; say which flag was wrong
        text = str(err).replace("cell_px", "--cell-px").replace("maze size", "--size").replace("seed must", "--seed must")
        print(f"daedalus maze: {text}", file=sys.stderr)
        return 2
    fmt = "PNG"
    if out is not None:  # after the arguments (a refused call creates no directory), before the maze is printed
        try:
            if Path(out).is_dir():
                raise UsageError(f"--out {out} is a directory; give the path of the PNG file to write")
            ext = Path(out).suffix.lower()
            if ext:  # the format its name says (.png, .jpg, .gif, .webp, ...); no extension: PNG
                fmt = Image.registered_extensions().get(ext, "")
                if fmt not in Image.SAVE:
                    raise UsageError(f"--out {out}: {ext} is not an image format Pillow writes; name a .png file "
                                     "(or .jpg, .gif, .webp)")
            make_dir(Path(out).parent, "--out")
        except UsageError as err:
            print(f"daedalus maze: {err}", file=sys.stderr)
            return 2
    print(
        f"Maze {maze.size}x{maze.size}, seed {seed}, layout {maze.layout_hash()}, start {maze.start}, "
        f"goal {maze.goal}, shortest path {len(moves)} moves"
    )
    print(render_ascii(maze, maze.start))
    print(f"Solution ({len(moves)} moves, then stop):")
    print("\n".join(lines))
    if out is not None:
        path = Path(out)
        try:
            Image.fromarray(image, mode="RGB").save(path, format=fmt)
        except OSError as err:  # permissions, a full disk
            print(f"daedalus maze: cannot write {path}: {err.strerror or err}", file=sys.stderr)
            return 2
        print(f"Wrote {path} ({image.shape[1]}x{image.shape[0]} px)")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--size --seed --out --cell-px --action-format`` to ``parser`` (for the ``daedalus`` CLI)."""
    parser.add_argument("--size", type=int, default=9, help="odd side length in cells, walls included (default 9)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--out", default=None, help="write the picture to this PNG file")
    parser.add_argument("--cell-px", type=int, default=25, help="pixels per cell (default 25, as VisGym)")
    parser.add_argument(
        "--action-format", choices=ACTION_FORMATS, default="function", help="syntax of the printed solution"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code of :func:`run`."""
    parser = argparse.ArgumentParser(prog="daedalus maze", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args.size, args.seed, args.out, cell_px=args.cell_px, action_format=args.action_format)


if __name__ == "__main__":
    sys.exit(main())
