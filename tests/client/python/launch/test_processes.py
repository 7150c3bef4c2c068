"""remove_dead_shm (muond.launch.processes): the launcher removes its own
job's shm objects whose creator is gone, and nothing of a job whose id
merely starts with its own (``run`` and ``run-20261203``), live or dead."""
import os
import subprocess
import sys
import unittest
import uuid

from muond.launch.processes import remove_dead_shm


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class RemoveDeadShmTest(unittest.TestCase):
    def make(self, job: str, pid: int) -> str:
        """An object named as muond.shm names one: muond-<job>-<pid>-<tag>-<n>."""
        path = f"/dev/shm/muond-{job}-{pid}-{uuid.uuid4().hex[:8]}-0"
        with open(path, "wb") as f:
            f.write(b"x")
        self.addCleanup(lambda: os.path.exists(path) and os.unlink(path))
        return path

    def test_only_the_own_jobs_objects_of_dead_creators_go(self):
        job = f"run{uuid.uuid4().hex[:6]}"
        longer = f"{job}-20261203"  # another job whose id extends this one's
        live, dead = os.getpid(), dead_pid()
        own_dead, own_live = self.make(job, dead), self.make(job, live)
        other_live, other_dead = self.make(longer, live), self.make(longer, dead)
        self.assertEqual(remove_dead_shm(job), [own_dead])
        self.assertFalse(os.path.exists(own_dead))
        for kept in (own_live, other_live, other_dead):
            self.assertTrue(os.path.exists(kept), kept)
        # That job's own launcher removes its dead creator's object.
        self.assertEqual(remove_dead_shm(longer), [other_dead])
        self.assertFalse(os.path.exists(other_dead))
        self.assertTrue(os.path.exists(other_live))

    def test_names_not_made_by_muond_shm_are_left_alone(self):
        job = f"run{uuid.uuid4().hex[:6]}"
        dead = dead_pid()
        odd = [f"/dev/shm/muond-{job}-{dead}", f"/dev/shm/muond-{job}-{dead}-XYZ-0",
               f"/dev/shm/muond-{job}-{dead}-{uuid.uuid4().hex[:8]}-0-extra"]
        for path in odd:
            with open(path, "wb") as f:
                f.write(b"x")
            self.addCleanup(lambda p=path: os.path.exists(p) and os.unlink(p))
        self.assertEqual(remove_dead_shm(job), [])
        for path in odd:
            self.assertTrue(os.path.exists(path), path)


if __name__ == "__main__":
    unittest.main()
