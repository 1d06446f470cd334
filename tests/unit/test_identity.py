"""Who is asking, from the header nats-server writes on the CLIENTS account's requests."""

from __future__ import annotations

import json

from gpusched.contracts.identity import REQUEST_INFO_HEADER, CallerKind, caller_from_headers

CLIENTS = "ACLIENTSACCOUNT"


def info(**fields: str) -> dict[str, str]:
    return {REQUEST_INFO_HEADER: json.dumps(fields)}


def test_a_request_without_the_header_comes_from_inside_the_service_account() -> None:
    caller = caller_from_headers({}, CLIENTS)
    assert caller.kind is CallerKind.SERVICE and caller.is_operator


def test_a_team_is_named_by_its_credential_and_acts_for_itself_only() -> None:
    caller = caller_from_headers(info(acc=CLIENTS, name_tag="team:vision"), CLIENTS)
    assert caller.kind is CallerKind.TEAM and caller.team == "vision"
    assert caller.may_act_for("vision") and not caller.may_act_for("nlp")
    assert not caller.is_operator


def test_an_operator_acts_for_every_team() -> None:
    caller = caller_from_headers(info(acc=CLIENTS, name_tag="operator:alice"), CLIENTS)
    assert caller.kind is CallerKind.OPERATOR and caller.name == "alice"
    assert caller.may_act_for("vision") and caller.is_operator


def test_a_header_from_another_account_or_without_a_role_is_nobody() -> None:
    for headers in (
        info(acc="AOTHER", name_tag="operator:alice"),
        info(acc=CLIENTS, name_tag="alice"),
        info(acc=CLIENTS, name_tag="team:"),
        {REQUEST_INFO_HEADER: "not json"},
        {REQUEST_INFO_HEADER: "[1, 2]"},
    ):
        caller = caller_from_headers(headers, CLIENTS)
        assert caller.kind is CallerKind.UNKNOWN, headers
        assert not caller.is_operator and not caller.may_act_for("vision")


def test_a_cluster_agent_submits_for_the_teams_its_credential_names_and_acts_for_none() -> None:
    headers = {
        REQUEST_INFO_HEADER: json.dumps(
            {"acc": CLIENTS, "name_tag": "agent:k8s", "tags": ["team:vision", "team:nlp", "x"]}
        )
    }
    caller = caller_from_headers(headers, CLIENTS)
    assert caller.kind is CallerKind.AGENT and caller.name == "k8s"
    assert caller.teams == {"vision", "nlp"}
    assert caller.may_submit_for("vision") and not caller.may_submit_for("audio")
    # Reading, cancelling or billing a team's jobs is not submitting.
    assert not caller.may_act_for("vision") and not caller.is_operator


def test_an_agent_without_team_tags_submits_for_no_team() -> None:
    for tags in ([], "team:vision", [7, None, "team:"]):
        headers = {
            REQUEST_INFO_HEADER: json.dumps({"acc": CLIENTS, "name_tag": "agent:k8s", "tags": tags})
        }
        caller = caller_from_headers(headers, CLIENTS)
        assert caller.kind is CallerKind.AGENT and not caller.may_submit_for("vision"), tags
