"""hvdkitrun's untagging of Horovod launcher output (hvdkit/launch/output.py)."""

import io

from hypothesis import given, settings
from hypothesis import strategies as st

from hvdkit.launch.output import RankOutput


def logs(tmp_path, rank, stream="stdout"):
    path = tmp_path / f"rank.{rank}" / stream
    return path.read_text().splitlines() if path.exists() else []


def test_a_line_split_by_another_ranks_write_goes_to_its_own_rank(tmp_path, capsys):
    # as captured from mpirun: rank 1 wrote its text, rank 0 its text and newline,
    # then rank 1 its newline
    out = RankOutput(tmp_path)
    out.feed("[1,1]<stdout>:rank 1 final loss 0.5[1,0]<stdout>:rank 0 final loss 0.5\n", "stdout")
    out.feed("[1,1]<stdout>:\n", "stdout")
    out.close()
    assert logs(tmp_path, 0) == ["rank 0 final loss 0.5"]
    assert logs(tmp_path, 1) == ["rank 1 final loss 0.5"]
    assert capsys.readouterr().out.splitlines() == [
        "[rank 0] rank 0 final loss 0.5",
        "[rank 1] rank 1 final loss 0.5",
    ]


def test_gloo_and_mpi_tags_streams_and_launcher_lines(tmp_path, capsys):
    out = RankOutput(tmp_path, prefix=False)
    out.feed("[0]<stderr>:oops\n", "stderr")  # Gloo: [rank]
    out.feed("[1,1]<stdout>:hi[1,1]<stdout>:\n", "stdout")  # MPI: text, then its newline
    out.feed("[1,0]<stdout>:\n", "stdout")  # print()
    out.feed("mpirun noticed something\n", "stderr")
    out.close()
    assert logs(tmp_path, 0, "stderr") == ["oops"]
    assert logs(tmp_path, 1) == ["hi"]
    assert logs(tmp_path, 0) == [""]
    assert list(out.launcher_lines) == ["mpirun noticed something"]
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["hi", ""]
    assert captured.err.splitlines() == ["oops", "mpirun noticed something"]


def test_a_last_line_without_newline_is_printed_when_the_pipe_ends(tmp_path):
    out = RankOutput(tmp_path)
    out.pump(io.StringIO("[1,0]<stdout>:first\n[1,0]<stdout>:no newline"), "stdout").join()
    assert logs(tmp_path, 0) == ["first", "no newline"]
    out.close()


def test_a_new_attempt_forgets_the_last_ones_unfinished_lines(tmp_path):
    out = RankOutput(tmp_path)
    out.feed("[1,0]<stdout>:cut off by a kill", "stdout")
    out.reset_tails()
    out.feed("[1,0]<stdout>:attempt 2\n", "stdout")
    out.close()
    assert logs(tmp_path, 0) == ["attempt 2"]


# Each rank prints lines; each print is one write ("text\n") or two ("text", "\n"),
# as unbuffered Python does, and a buffered flush writes several lines at once.
# mpirun tags every write and every line begun inside one, empty ones too (as
# Open MPI 4.1.4 does: os.write(1, b"\n\nx\n") comes out as three tagged lines),
# and passes the writes of different ranks through in any order that keeps
# each rank's own order.
line_text = st.text(alphabet="abc xyz.0123[]<>:", max_size=12)


def mpirun_tagged(rank: int, write: str) -> str:
    tag = f"[7,{rank}]<stdout>:"
    pieces = write.split("\n")
    tagged = [tag + piece for piece in pieces[:-1]]
    return "\n".join([*tagged, tag + pieces[-1] if pieces[-1] else ""])


@st.composite
def interleaved_writes(draw):
    printed = {r: draw(st.lists(line_text, max_size=6)) for r in range(3)}
    writes = {}
    for r, lines in printed.items():
        writes[r], i = [], 0
        while i < len(lines):
            how = draw(st.sampled_from(["whole", "text then newline", "two lines"]))
            if how == "two lines" and i + 1 < len(lines):
                writes[r].append(lines[i] + "\n" + lines[i + 1] + "\n")
                i += 2
                continue
            writes[r] += [lines[i] + "\n"] if how == "whole" else [lines[i], "\n"]
            i += 1
    order = []
    pending = {r: list(ws) for r, ws in writes.items() if ws}
    while pending:
        r = draw(st.sampled_from(sorted(pending)))
        order.append((r, pending[r].pop(0)))
        if not pending[r]:
            del pending[r]
    return printed, order


@settings(max_examples=200, deadline=None)
@given(interleaved_writes())
def test_every_rank_gets_exactly_its_lines_whatever_the_interleaving(tmp_path_factory, case):
    printed, order = case
    stream = "".join(mpirun_tagged(r, w) for r, w in order)
    tmp = tmp_path_factory.mktemp("logs")
    out = RankOutput(tmp)
    out.pump(io.StringIO(stream), "stdout").join()
    out.close()
    for r, lines in printed.items():
        assert logs(tmp, r) == lines, (r, stream)
    assert list(out.launcher_lines) == []
