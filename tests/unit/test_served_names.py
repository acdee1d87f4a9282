"""Served names (vLLM's --served-model-name) on the balancer's HTTP API, with the
scripted generator of tests/helpers/tool_api.py: requests may name any served name
or leave model out, responses carry the first, /v1/models lists them all (the first
first), other names are 404s naming model; the setting's and `infermesh up`'s forms."""

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from services.balancer.frontend.api import create_app
from shared.recipe import Recipe
from shared.runtime.settings import BalancerSettings, load_settings
from shared.runtime.vllm_metrics import served_model_name, served_model_names
from tests.helpers.tool_api import Scripted
from tools.launch.up import served_names_env
from tools.make_model import make_model

NAMES = ("main-name", "alias-a", "org/alias-b")


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    folder = tmp_path_factory.mktemp("served-names")
    make_model(folder)
    generator = Scripted(Recipe.from_pretrained(folder))
    generator.reply = "Yes."
    app = create_app(generator=generator, recipe=generator.recipe, model_name=NAMES[0], aliases=NAMES[1:],
                     max_model_len=256, settings=BalancerSettings())
    with TestClient(app, base_url="http://balancer") as client:
        yield client


def test_any_served_name_or_none_answers_with_the_first(http: TestClient) -> None:
    client = openai.OpenAI(base_url="http://balancer/v1", api_key="x", http_client=http, max_retries=0)
    for name in NAMES:
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
        assert (reply.model, reply.choices[0].message.content) == (NAMES[0], "Yes.")
        assert client.completions.create(model=name, prompt="hi").model == NAMES[0]
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/tokenize", {"prompt": "hi"})]:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.json().get("model", NAMES[0]) == NAMES[0]


def test_models_lists_every_name_first_first(http: TestClient) -> None:
    client = openai.OpenAI(base_url="http://balancer/v1", api_key="x", http_client=http, max_retries=0)
    assert [m.id for m in client.models.list().data] == list(NAMES)
    assert client.models.retrieve("org/alias-b").id == "org/alias-b"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_other_names_are_404s_naming_model(http: TestClient) -> None:
    response: httpx.Response = http.post("/v1/chat/completions", json={"model": "other", "messages": [
        {"role": "user", "content": "hi"}]})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_the_setting_and_the_up_flag() -> None:
    settings = load_settings(env=served_names_env(["a", "b c", "d"]))
    assert settings.balancer.model_name == "a,b c,d"
    assert served_model_names(settings.balancer.model_name, "/models/folder") == ("a", "b c", "d")
    assert served_model_name(settings.balancer.model_name, "/models/folder") == "a"  # what metrics carry
    assert served_model_names(None, "/models/folder") == ("folder",)
    assert served_names_env(None) == {}
    for bad in (["a,b"], [" "], ["a", "a"]):
        with pytest.raises(ValueError, match="--served-model-name"):
            served_names_env(bad)


def test_up_refuses_a_bad_name_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools.launch.up import up

    state = tmp_path / "state"
    assert up(str(tmp_path), 1, 1, 8000, str(state), False, served_model_names=["a", "b,c"]) == 2
    assert "--served-model-name: 'b,c'" in capsys.readouterr().err and not state.exists()
