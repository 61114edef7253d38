"""The master's side of a node changing role: the admin call, no new work while it switches, and
the node's new registration taken in place (``RoleChanged``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_cluster import protocol
from tests.master_fakes import (
    ADMIN_HEADERS,
    FakeNode,
    LiveMaster,
    make_settings,
    register_msg,
    wait_until,
    write_model_dir,
)


@pytest.fixture
async def master(tmp_path: Path):
    async with LiveMaster(make_settings(write_model_dir(tmp_path))) as m:
        yield m


async def _join(master: LiveMaster, node_id: str, role: str) -> FakeNode:
    node = FakeNode(master, node_id, role)
    assert isinstance(await node.join(), protocol.Registered)
    return node


async def test_a_mixed_node_becomes_a_decode_node_in_place(master):
    p0, m0 = await _join(master, "p0", "prefill"), await _join(master, "m0", "mixed")
    response = await master.http.post("/admin/nodes/m0/role", json={"role": "decode"}, headers=ADMIN_HEADERS)
    assert response.status_code == 200, response.text
    assert (response.json()["role"], response.json()["pending_role"], response.json()["state"]) == (
        "mixed", "decode", "switching")
    await wait_until(lambda: m0.set_roles == ["decode"], what="SetRole")
    record = master.ctx.registry.get("m0")
    assert not record.active and master.ctx.registry.active("mixed") == []
    assert 'pdc_nodes{role="mixed",state="switching"} 1.0' in (await master.http.get("/metrics")).text
    registered_at = record.registered_at
    # The node finished its old role's work and registers as a decode node, on the same link.
    await m0.send(protocol.RoleChanged(info=register_msg("m0", "decode")))
    await wait_until(lambda: record.role == "decode" and record.active, what="the new role")
    assert record.pending_role is None and record.registered_at == registered_at
    await wait_until(lambda: p0.decode_peers is not None and "m0" in p0.decode_peers, what="P told of the new D")
    metrics = (await master.http.get("/metrics")).text
    assert 'pdc_role_changes_total{from_role="mixed",outcome="done",to_role="decode"} 1.0' in metrics
    assert (await master.nodes())["m0"]["role"] == "decode"
    for node in (p0, m0):
        await node.close()


async def test_a_failed_change_leaves_the_node_in_its_old_role_and_routed_to(master):
    m0 = await _join(master, "m0", "mixed")
    await master.http.post("/admin/nodes/m0/role", json={"role": "prefill"}, headers=ADMIN_HEADERS)
    await wait_until(lambda: m0.set_roles == ["prefill"], what="SetRole")
    await m0.send(protocol.RoleChanged(info=register_msg("m0", "mixed"), failed="RuntimeError: no room"))
    record = master.ctx.registry.get("m0")
    await wait_until(lambda: record.active, what="the node back in service")
    assert record.role == "mixed" and record.pending_role is None
    metrics = (await master.http.get("/metrics")).text
    assert 'pdc_role_changes_total{from_role="mixed",outcome="failed",to_role="mixed"} 1.0' in metrics
    await m0.close()


async def test_a_role_change_is_refused_clearly(master):
    d0 = await _join(master, "d0", "decode")
    post = master.http.post
    assert (await post("/admin/nodes/d0/role", json={"role": "mixed"})).status_code == 401
    unknown = await post("/admin/nodes/nope/role", json={"role": "mixed"}, headers=ADMIN_HEADERS)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "node_not_found"
    bad = await post("/admin/nodes/d0/role", json={"role": "teacher"}, headers=ADMIN_HEADERS)
    assert bad.status_code in (400, 422) and "error" in bad.json()
    await post("/admin/nodes/d0/drain", headers=ADMIN_HEADERS)
    draining = await post("/admin/nodes/d0/role", json={"role": "mixed"}, headers=ADMIN_HEADERS)
    assert draining.status_code == 409 and draining.json()["error"]["code"] == "node_draining"
    assert d0.set_roles == []
    await d0.close()


async def test_a_node_switching_on_another_masters_word_gets_no_new_work_here(master):
    m0 = await _join(master, "m0", "mixed")
    m0.status = m0.status.model_copy(update={"switching_to": "prefill"})
    record = master.ctx.registry.get("m0")
    await wait_until(lambda: record.state == "switching", what="the switch seen in the status")
    assert record.pending_role == "prefill" and not record.active
    await m0.close()
