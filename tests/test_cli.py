"""`jaxfill generate` as a user runs it: a real subprocess, the installed console script."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAXFILL = shutil.which("jaxfill") or f"{sys.executable} -m jaxfill.serving.cli"


def jaxfill(*args, timeout=600):
    cmd = JAXFILL.split() + list(args)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_streams_text_and_json_matches():
    out = jaxfill("generate", "--config", "configs/tiny.toml", "--prompt", "Hello", "--prompt", "Hi there",
                  "--max-tokens", "16", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    for row in rows:
        assert set(row) >= {"token_ids", "text", "finish_reason"}
        assert 1 <= len(row["token_ids"]) <= 16 and row["finish_reason"] in ("stop", "length")
    ids = jaxfill("generate", "--prompt-ids", "256,72,101,108,108,111", "--max-tokens", "16", "--json")
    assert ids.returncode == 0, ids.stderr
    assert json.loads(ids.stdout.splitlines()[-1])["token_ids"] == rows[0]["token_ids"]  # "Hello" == its bytes


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1,2,99999"], "token id 99999 is outside the vocabulary"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--top-p", "0"], "top_p"),
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["--prompt", "x" * 5000], "max_model_len"),
    (["--prompt", "hi", "--set", "mesh.tensr=2"], "unknown key 'mesh.tensr'"),
    (["--prompt", "hi", "--config", "nope"], "neither a file nor a preset"),
    (["--prompt", "hi", "--config", "hardware"], "neither a file nor a preset"),
    (["--prompt-ids", "1", "--model", "{tmp}/missing"], "does not exist"),
    (["--prompt-ids", "1", "--model", "{tmp}"], "has no config.json"),
])
def test_bad_input_is_one_clear_line(args, message, capsys, tmp_path):
    from jaxfill.serving.cli import main

    assert main(["generate", *(a.format(tmp=tmp_path) for a in args)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("command", [["plan"], ["bench", "prefill", "--lengths", "16"]])
def test_missing_model_directory_in_every_command(command, capsys, tmp_path):
    from jaxfill.serving.cli import main

    assert main([*command, "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and err.count("\n") == 1


def test_checkpoint_shorter_than_the_preset_loads_as_it_comes(hf_dirs, capsys, caplog):
    """The HF test checkpoint allows 1024 positions; the preset asks 4096 by default."""
    from jaxfill.serving.cli import main

    assert main(["generate", "--config", "tiny_random", "--model", hf_dirs["llama"], "--prompt-ids", "1,2,3",
                 "--max-tokens", "4", "--json", "--set", "engine.num_pages=64"]) == 0
    out = capsys.readouterr()
    assert len(json.loads(out.out.splitlines()[-1])["token_ids"]) == 4
    assert any("engine.max_model_len 4096 -> 1024" in r.getMessage() for r in caplog.records)


def test_bad_input_exit_code_from_the_console_script():
    out = jaxfill("generate", "--prompt", "hi", "--top-k", "-3")
    assert out.returncode == 2 and "top_k" in out.stderr and "Traceback" not in out.stderr


def test_multi_process_flags_become_mesh_settings():
    from jaxfill.engine.config import load_config
    from jaxfill.serving.cli import build_parser

    args = build_parser().parse_args(["serve", "--set", "mesh.tensor=2", "--coordinator", "10.0.0.1:8476",
                                      "--num-processes", "2", "--process-id", "1"])
    mesh = load_config(args.config, args.overrides).mesh
    assert (mesh.tensor, mesh.coordinator, mesh.num_processes, mesh.process_id) == (2, "10.0.0.1:8476", 2, 1)
    with pytest.raises(SystemExit):  # only commands that can run as N processes take them
        build_parser().parse_args(["plan", "--coordinator", "10.0.0.1:8476"])


@pytest.mark.parametrize("quantization,message", [
    ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 64, "zero_point": True},
     "quantization_config.version='gemv' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128, "desc_act": False, "sym": True},
     "quantization_config.bits=3 is not supported"),
    ({"quant_method": "bitsandbytes"}, "field 'quantization_config' (= {'quant_method': 'bitsandbytes'}) is not understood"),
])
@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1"], ["plan"]])
def test_unsupported_quantization_config_is_one_line(quantization, message, command, capsys, tmp_path):
    """A checkpoint's quantization_config the engine cannot load: one line naming the field,
    exit 2, before any weight is looked for (the directory holds config.json alone)."""
    from jaxfill.serving.cli import main

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
              "quantization_config": quantization}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main([*command, "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
