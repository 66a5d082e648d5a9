"""The same SGLang-style programs over HTTP: RuntimeEndpoint and sgl.Runtime against a
server subprocess (`python -m sgl.launch_server`), plus the OpenAI backend on its /v1 API."""

from __future__ import annotations

import pytest

import sgl
from tests.test_lang_programs import CHECKS, multi_turn

pytestmark = [pytest.mark.model, pytest.mark.server, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def runtime():
    rt = sgl.Runtime(launch_timeout=600)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module", params=["endpoint", "runtime"])
def backend(request, runtime):
    if request.param == "runtime":
        return runtime  # a Runtime is accepted wherever a backend is
    return sgl.RuntimeEndpoint(runtime.url)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_program_over_http(backend, name):
    CHECKS[name](backend)


def test_endpoint_uses_the_model_chat_template(runtime):
    tmpl = sgl.RuntimeEndpoint(runtime.url).get_chat_template()
    assert tmpl.get_prefix_and_suffix("user") == ("<|im_start|>user\n", "<|im_end|>\n")
    assert tmpl.stop_str == ("<|im_end|>",)


def test_bad_request_is_raised_with_context(runtime):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", max_tokens=4, top_p=5.0)

    with pytest.raises(sgl.ProgramError) as info:
        prog.run(backend=runtime)
    assert "top_p" in str(info.value)
    assert info.value.state.error() is info.value


def test_openai_backend_chat_and_unsupported_features(runtime):
    info = runtime.endpoint.model_info
    model = info.get("served_model_name") or info["model_path"]
    backend = sgl.OpenAI(model, base_url=runtime.url + "/v1", api_key="none")
    st = multi_turn.run("Which city is the capital of France?", "And of Japan?", backend=backend, temperature=0)
    assert [m["role"] for m in st.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert "paris" in st["a1"].lower()

    @sgl.function
    def needs_logprobs(s):
        s += sgl.user("Pick one.")
        s += sgl.assistant(sgl.select("c", ["a", "b"]))

    with pytest.raises(sgl.ProgramError, match="select"):
        needs_logprobs.run(backend=backend)
