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


# --- the relay as a console (issue 35): bytes, long lines, carriage returns ---------


class Chunks:
    """A pipe that returns the given byte chunks, then its end."""

    def __init__(self, chunks):
        self.chunks = list(chunks)

    def read1(self, _n):
        return self.chunks.pop(0) if self.chunks else b""


def test_bad_bytes_are_replaced_and_split_characters_joined(tmp_path, capsys):
    e = "é".encode()
    out = RankOutput(tmp_path)
    chunks = [b"[1,0]<stdout>:a \xff b\n[1,0]<stdout>:x" + e[:1], e[1:] + b"y\n"]
    out.pump(Chunks(chunks), "stdout").join()
    out.close()
    assert logs(tmp_path, 0) == ["a \ufffd b", "xéy"]
    assert capsys.readouterr().out.splitlines() == ["[rank 0] a \ufffd b", "[rank 0] xéy"]


def test_a_tag_cut_between_two_reads_is_still_a_tag(tmp_path):
    out = RankOutput(tmp_path)
    out.pump(Chunks([b"[1,0]<stdout>:one\n[1,", b"1]<std", b"out>:two\n"]), "stdout").join()
    out.close()
    assert logs(tmp_path, 0) == ["one"] and logs(tmp_path, 1) == ["two"]
    assert list(out.launcher_lines) == []


def test_a_long_line_reaches_the_log_whole_and_the_console_in_pieces(tmp_path, capsys):
    from hvdkit.launch.output import MAX_PIECE

    n = 3 * MAX_PIECE + 5
    out = RankOutput(tmp_path, prefix=False)
    out.pump(Chunks([b"[0]<stdout>:" + b"L" * n + b"\n"]), "stdout").join()
    out.close()
    assert logs(tmp_path, 0) == ["L" * n]
    console = capsys.readouterr().out.splitlines()
    assert [len(c) for c in console] == [MAX_PIECE] * 3 + [5]


def test_carriage_returns_update_the_console_line_in_place(tmp_path, capsys):
    # Keras's Progbar on a POSIX system: backspaces over the old bar, \r, the new bar
    out = RankOutput(tmp_path)
    out.feed("[1,0]<stdout>:\r1/3 =\b\b\b\b\b\r2/3 ==", "stdout")
    out.feed("[1,1]<stdout>:other\n", "stdout")  # another rank's line closes the update
    out.feed("[1,0]<stdout>:\b\b\b\b\b\b\r3/3 ===\n", "stdout")
    out.close()
    assert logs(tmp_path, 0) == ["3/3 ==="] and logs(tmp_path, 1) == ["other"]
    assert capsys.readouterr().out == (
        "[rank 0] 1/3 =\r[rank 0] 2/3 ==\n[rank 1] other\n[rank 0] 3/3 ===\n"
    )


def test_a_bar_left_on_a_carriage_return_ends_as_its_last_update(tmp_path):
    out = RankOutput(tmp_path)
    out.feed("[0]<stdout>:50%\r[0]<stdout>:100%\r", "stdout")
    out.feed("[0]<stdout>:\n", "stdout")
    out.close()
    assert logs(tmp_path, 0) == ["100%"]


def test_an_error_inside_the_relay_is_reported_and_the_pipe_drained(tmp_path, capsys):
    out = RankOutput(tmp_path)
    calls = []

    def broken(text):
        calls.append(text)
        raise RuntimeError("boom")

    out.feed = lambda text, stream: broken(text)
    out.pump(Chunks([b"a\n", b"b\n", b"c\n"]), "stdout").join()
    assert calls == [b"a\n", b"b\n", b"c\n"]  # every chunk was read
    err = capsys.readouterr().err
    assert err.count("error relaying the ranks' stdout (RuntimeError: boom)") == 1


def test_tag_pipe_tags_lines_and_updates_and_takes_any_bytes():
    import os

    from hvdkit.launch.output import tag_pipe

    r, w = os.pipe()
    os.write(w, b"a\rb\n\xffc")
    os.close(w)
    dst = io.StringIO()
    tag_pipe(r, dst, "[0]<stdout>:")
    os.close(r)
    assert dst.getvalue() == "[0]<stdout>:a\r[0]<stdout>:b\n[0]<stdout>:\ufffdc"


def test_tag_pipes_of_many_ranks_never_cut_each_others_lines_on_an_unbuffered_console():
    # horovodrun runs one tag_pipe thread per rank and stream, all writing to one
    # console; under PYTHONUNBUFFERED=1 it has no buffer, and writes over 4 KiB to a
    # pipe that a slower reader drains are interleaved by the kernel unless the
    # relays take turns (the CI of bd6a879 lost the end of a line this way).
    import os
    import threading
    import time

    from hvdkit.launch.output import tag_pipe

    ranks, lines = 4, 5000
    r_out, w_out = os.pipe()
    console = io.TextIOWrapper(io.FileIO(w_out, "w"), encoding="utf-8", write_through=True)
    received = []

    def slow_reader():
        while data := os.read(r_out, 3000):
            received.append(data)
            time.sleep(0.0001)

    def rank_program(fd, rank):
        for i in range(lines):
            os.write(fd, f"rank {rank} line {i} {'x' * 40}\n".encode())
        os.close(fd)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    threads = []
    for rank in range(ranks):
        r, w = os.pipe()
        threads.append(threading.Thread(target=rank_program, args=(w, rank)))
        threads.append(threading.Thread(target=tag_pipe, args=(r, console, f"[{rank}]<stdout>:")))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    console.close()
    reader.join()
    os.close(r_out)
    got = b"".join(received).decode().splitlines()
    for rank in range(ranks):
        mine = [ln for ln in got if ln.startswith(f"[{rank}]<stdout>:")]
        assert mine == [f"[{rank}]<stdout>:rank {rank} line {i} {'x' * 40}" for i in range(lines)]
    assert len(got) == ranks * lines


# Any bytes, cut anywhere: tag_pipe (the Gloo side) and RankOutput (hvdkitrun's side)
# together put into the log exactly what a UTF-8 decoder with replacement reads,
# with the text of each line as it stands after its last carriage return.
any_text = st.lists(
    st.one_of(st.binary(max_size=8), st.sampled_from([b"\n", b"\r", b"\r\n", "é━".encode()])),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(any_text, st.integers(1, 7))
def test_any_bytes_cut_anywhere_arrive_as_a_decoder_reads_them(tmp_path_factory, parts, cut):
    import os

    from hvdkit.launch.output import tag_pipe

    data = b"".join(parts)
    r, w = os.pipe()
    os.write(w, data)
    os.close(w)
    tagged = io.StringIO()
    tag_pipe(r, tagged, "[0]<stdout>:")
    os.close(r)
    raw = tagged.getvalue().encode()
    tmp = tmp_path_factory.mktemp("logs")
    out = RankOutput(tmp)
    out.pump(Chunks([raw[i : i + cut] for i in range(0, len(raw), cut)]), "stdout").join()
    out.close()
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n")
    *ended, unfinished = text.split("\n")
    want = []
    for line in [*ended, unfinished]:
        updates = [u.replace("\b", "") for u in line.split("\r")]
        shown = [u for u in updates if u]
        want.append(updates[-1] or (shown[-1] if shown else ""))
    if want[-1] == "":
        want.pop()  # an unfinished line with nothing to show is not a line
    path = tmp / "rank.0" / "stdout"
    got = path.read_text(encoding="utf-8").split("\n")[:-1] if path.exists() else []
    assert got == want
