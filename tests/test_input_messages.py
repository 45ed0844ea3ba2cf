"""What a bad input's messages say: rows of another layout than --input-format names, a
conversation stored as JSON text (as exported Parquet datasets hold it), outputs of different
jobs given to merge, and tool-call arguments holding NaN under every profile."""

from __future__ import annotations

import json
import shutil

import pytest

from preprocess.errors import RejectError
from preprocess.formats import to_openai_row
from preprocess.job import PreprocessConfig, run_preprocess
from preprocess.job.identity import describe_job_differences, job_differences
from preprocess.pipeline import SampleOptions, process_row
from shards_schema import open_shards
from tests.helpers.cli import vlmpack_exit_code

MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
CONVERSATIONS = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]


# ---------------------------------------------------------------- a row of another layout


@pytest.mark.parametrize("row, named, given, fix", [
    ({"messages": MESSAGES}, "sharegpt", "has `messages` with `role` / `content`, the OpenAI layout",
     "use --input-format openai"),
    ({"messages": MESSAGES, "images": []}, "sharegpt", "has `messages` with `role` / `content`, the ms-swift",
     "use --input-format swift"),
    ({"messages": json.dumps(MESSAGES)}, "sharegpt", "has `messages` with `role` / `content`",
     "use --input-format openai"),
    ({"conversations": CONVERSATIONS}, "openai", "has `conversations` with `from` / `value`, the ShareGPT layout",
     "use --input-format sharegpt"),
    ({"conversations": CONVERSATIONS, "messages": None}, "swift", "has `conversations` with `from` / `value`",
     "use --input-format sharegpt"),
])
def test_a_row_of_another_layout_names_the_input_format_that_reads_it(row, named, given, fix):
    with pytest.raises(RejectError) as err:
        to_openai_row(row, named)
    assert err.value.code == "no_messages"
    assert given in err.value.message and fix in err.value.message, err.value.message
    assert f"--input-format {named} reads" in err.value.message


def test_each_row_rejected_under_the_wrong_input_format_says_the_flag_to_use(tmp_path):
    """A whole ShareGPT input named as OpenAI rows (and the reverse): every row is rejected, each
    reject in rejects.jsonl saying which --input-format reads it."""
    (tmp_path / "sharegpt.jsonl").write_text(json.dumps({"conversations": CONVERSATIONS}) + "\n")
    (tmp_path / "openai.jsonl").write_text(json.dumps({"messages": MESSAGES}) + "\n")
    for name, given, right in (("sharegpt.jsonl", "openai", "sharegpt"), ("openai.jsonl", "sharegpt", "openai")):
        out = tmp_path / f"out-{given}"
        run_preprocess(PreprocessConfig(inputs=[str(tmp_path / name)], out=str(out), workers=1, progress=False,
                                        input_format=given))
        reject, = map(json.loads, (out / "rejects.jsonl").read_text().splitlines())
        assert reject["code"] == "no_messages" and f"use --input-format {right}" in reject["reason"], reject


def test_a_row_of_another_layout_in_an_input_read_by_auto_says_to_split_the_input(tmp_path):
    """Under --input-format auto an input's layout comes from its first row: a later row of the
    other layout is rejected saying so, not told to use auto (which the user already does)."""
    rows = [{"messages": MESSAGES}, {"conversations": CONVERSATIONS}, {"messages": MESSAGES}]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    manifest = run_preprocess(PreprocessConfig(inputs=[str(tmp_path / "mixed.jsonl")], out=str(out), workers=1,
                                               progress=False))
    reject, = map(json.loads, (out / "rejects.jsonl").read_text().splitlines())
    assert reject["row"] == 1 and reject["code"] == "no_messages", reject
    assert ("--input-format auto read this input as openai, the layout of its first row with turns: put rows of "
            "each layout in an input of their own") in reject["reason"], reject
    assert "or auto" not in reject["reason"]
    assert manifest["accounting"]["rows_written"] == 2


@pytest.mark.parametrize("input_format", ["auto", "sharegpt"])
def test_a_table_with_no_column_of_turns_is_refused_once_naming_its_columns(tmp_path, capsys, input_format):
    """Every row of a Parquet file shares its columns: without `messages` or `conversations` the
    job is refused before it starts (one line, exit 2), not each row rejected."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b"], "image": ["x.png", "y.png"]}), tmp_path / "captions.parquet")
    out = tmp_path / "out"
    code = vlmpack_exit_code(["preprocess", str(tmp_path / "captions.parquet"), "--out", str(out), "--workers", "1",
                              "--input-format", input_format])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert (f"input {tmp_path / 'captions.parquet'}: no `messages` or `conversations` column (its columns: text, "
            "image); vlmpack reads each row's chat from one of them: rename the column that holds the turns") in err
    assert not out.exists()


# ---------------------------------------------------------------- a conversation as JSON text


def test_messages_as_a_json_string_column_are_read_as_their_list_and_bad_ones_named(tmp_path, builtin_profiles):
    """A Parquet `messages` column of strings (JSON text of the list): a valid one gives the
    sample the list gives; text that is not JSON, or not a list, is rejected naming `messages`,
    that it is a string, and the fix. The other rows are written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    other = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    texts = [json.dumps(MESSAGES), '[{"role": "user", "content": "Hi"', "Hi there", json.dumps(other, indent=1)]
    pq.write_table(pa.table({"messages": texts}), tmp_path / "chats.parquet")
    out = tmp_path / "out"
    manifest = run_preprocess(PreprocessConfig(inputs=[str(tmp_path / "chats.parquet")], out=str(out), workers=1,
                                               progress=False))
    rejects = {r["row"]: r for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())}
    assert {row: r["code"] for row, r in rejects.items()} == {1: "bad_json", 2: "no_messages"}
    assert rejects[1]["reason"].startswith("`messages`, a string read as the JSON text of its list of turns, is not "
                                           "valid JSON")
    assert "write `messages` as a list of turn objects, or as valid JSON text of one" in rejects[1]["reason"]
    assert "`messages` is a string (8 characters, starting 'Hi there'), not a list of turns" in rejects[2]["reason"]
    assert manifest["accounting"]["rows_written"] == 2
    shards = open_shards(out)
    for k, given in enumerate((MESSAGES, other)):
        want = process_row({"messages": given}, sample_uid="x", source="x", profile=builtin_profiles["qwen3-vl"],
                           options=SampleOptions())
        assert shards[k]["input_ids"].tolist() == want.input_ids.tolist()
        assert shards[k]["loss_mask"].tolist() == want.loss_mask.tolist()


def test_conversations_as_json_text_are_read_as_sharegpt_turns():
    row = to_openai_row({"conversations": json.dumps(CONVERSATIONS), "system": "Be brief."}, "sharegpt")
    assert row["messages"] == [{"role": "system", "content": "Be brief."}, *MESSAGES]


# ---------------------------------------------------------------- merge of different jobs


def _job_file(directory) -> dict:
    return json.loads((directory / "_parts" / "job.json").read_text())


def test_merging_outputs_of_different_jobs_names_each_difference_and_the_fix(tmp_path, capsys):
    """Two outputs whose jobs differ in --max-seq-len and --loss-policy (the second's job file
    edited as another run would write it): merge exits 2 with one line naming both settings,
    each with its value in either directory, and what to do instead."""
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": MESSAGES}) + "\n")
    first, second = tmp_path / "first", tmp_path / "second"
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(first), workers=1, progress=False))
    shutil.copytree(first, second)
    identity = _job_file(first)
    identity["settings"].update(max_seq_len=4096, loss_policy="last_assistant")
    (second / "_parts" / "job.json").write_text(json.dumps(identity))
    code = vlmpack_exit_code(["merge", str(first), str(second), "--out", str(tmp_path / "merged")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--max-seq-len: 16384 in {first}, 4096 in {second}" in err
    assert f"--loss-policy: all_assistant in {first}, last_assistant in {second}" in err
    assert "merge cannot join" in err and "`vlmpack pack`" in err
    assert not (tmp_path / "merged").exists()


def test_a_rerun_into_an_output_with_another_setting_names_the_setting_and_both_values(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": MESSAGES}) + "\n")
    out = tmp_path / "out"
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(out), workers=1, progress=False))
    code = vlmpack_exit_code(["preprocess", str(data), "--out", str(out), "--workers", "1", "--max-seq-len", "4096"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--max-seq-len: 16384 in {out}, 4096 in this run" in err and "re-run with the settings" in err, err


def test_job_differences_name_the_profile_inputs_and_partitions_that_differ(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": MESSAGES}) + "\n")
    run_preprocess(PreprocessConfig(inputs=[str(data)], out=str(tmp_path / "out"), workers=1, progress=False))
    base = _job_file(tmp_path / "out")
    assert job_differences(base, json.loads(json.dumps(base))) == []

    def changed(edit) -> dict:
        other = json.loads(json.dumps(base))
        edit(other)
        return other

    name = base["profile"]["name"]
    cases = [
        (lambda j: j["profile"].update(name="qwen2.5-vl", family="qwen2.5-vl", id="x"),
         ("--profile", name, "qwen2.5-vl")),
        (lambda j: j["profile"]["vision"].update(min_pixels=3136),
         ("the profile's vision.min_pixels (--min-pixels)", base["profile"]["vision"]["min_pixels"], 3136)),
        (lambda j: j.update(num_partitions=3), ("--num-partitions", 1, 3)),
        (lambda j: j["settings"]["video"].update(sampling="qwen-vl-utils"),
         ("--video-sampling", "hf", "qwen-vl-utils")),
        (lambda j: j["inputs"][0].update(path="other.jsonl"), ("the inputs", base["inputs"][0]["path"], "other.jsonl")),
        (lambda j: j["inputs"][0]["fingerprint"].update(mode="full"), ("--input-hash", "sampled", "full")),
        (lambda j: j["inputs"][0].update(row_format="sharegpt"),
         (f"the layout (--input-format) of input {base['inputs'][0]['path']}", "openai", "sharegpt")),
    ]
    for edit, want in cases:
        assert job_differences(base, changed(edit)) == [want]
    text = describe_job_differences(base, changed(cases[0][0]), "A", "B")
    assert text == f"--profile: {name} in A, qwen2.5-vl in B"


# ---------------------------------------------------------------- NaN in tool-call arguments


def _tool_row(arguments) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"type": "function", "function": {"name": "f", "arguments": arguments}}]},
                         {"role": "tool", "content": "r"}, {"role": "assistant", "content": "done"}]}


@pytest.mark.parametrize("profile_name", ["qwen3.5", "qwen3.6", "qwen3-vl"])  # qwen2.5-vl renders no tools
def test_tool_call_arguments_holding_nan_or_infinity_are_rejected_by_every_profile(profile_name):
    """Arguments as a JSON string (OpenAI's layout) or parsed from the row's JSON, holding NaN
    or an infinity: `bad_tool_call` on every profile, Qwen3.5 (whose template writes scalars
    with `|string`, `nan`) included; the same arguments with finite numbers are written."""
    from preprocess.profiles import builtin_profile

    profile = builtin_profile(profile_name)

    def process(arguments):
        return process_row(_tool_row(arguments), sample_uid="x", source="x", profile=profile, options=SampleOptions())

    for arguments in ('{"x": NaN}', '{"x": -Infinity}', '{"x": 1e999}', '{"x": [1, {"y": NaN}]}',
                      json.loads('{"x": NaN}'), {"x": float("inf")}):
        with pytest.raises(RejectError) as err:
            process(arguments)
        assert err.value.code == "bad_tool_call", (arguments, err.value)
        assert "holds a value JSON cannot hold" in err.value.message and "write NaN and infinite numbers as strings" \
            in err.value.message
    process('{"x": 1.5, "y": "NaN"}')
    process({"x": 1e308, "y": [1, -0.0]})


@pytest.mark.parametrize("json_scalars", [False, True], ids=["qwen3.5", "qwen3.6"])
def test_qwen3_5_templates_write_no_argument_json_cannot_hold(json_scalars):
    """The Qwen3.5 / Qwen3.6 parameter writer itself refuses NaN and infinities, whatever reaches
    it, and writes finite scalars as each template does."""
    from preprocess.families.qwen3_5 import _argument_text

    for value in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(RejectError) as err:
            _argument_text(value, json_scalars=json_scalars, index=1, where="tool_calls[0].arguments.x")
        assert err.value.code == "bad_tool_call" and "tool_calls[0].arguments.x" in err.value.message
    written = [_argument_text(v, json_scalars=json_scalars, index=1, where="w") for v in (True, None, 0.5)]
    assert written == (["true", "null", "0.5"] if json_scalars else ["True", "None", "0.5"])
