"""The environment the launcher gives a service process."""

from specdec.launcher import MALLOC_ARENAS, OPENMP_SPIN_COUNT, REPO_ROOT, service_env


def test_a_service_gets_the_short_openmp_spin_unless_the_operator_chose_one():
    env = service_env({"SPECDEC_X": "1"}, {"PATH": "/bin", "PYTHONPATH": "/elsewhere"})
    assert env["GOMP_SPINCOUNT"] == OPENMP_SPIN_COUNT and env["SPECDEC_X"] == "1" and env["PATH"] == "/bin"
    assert env["PYTHONPATH"].split(":") == [str(REPO_ROOT), "/elsewhere"] and env["PYTHONUNBUFFERED"] == "1"
    assert service_env({}, {"GOMP_SPINCOUNT": "300000"})["GOMP_SPINCOUNT"] == "300000"
    assert service_env({"GOMP_SPINCOUNT": "0"}, {})["GOMP_SPINCOUNT"] == "0"
    assert "GOMP_SPINCOUNT" not in service_env({}, {"OMP_WAIT_POLICY": "ACTIVE"})


def test_a_service_gets_few_malloc_arenas_unless_the_operator_chose_a_count():
    assert service_env({}, {})["MALLOC_ARENA_MAX"] == MALLOC_ARENAS
    assert service_env({}, {"MALLOC_ARENA_MAX": "8"})["MALLOC_ARENA_MAX"] == "8"
