-- Placeholder job_submit plugin: accepts every job unchanged.
-- The MAPA directive validator replaces this file (it is bind-mounted; slurmctld reloads it
-- when its modification time changes).

function slurm_job_submit(job_desc, part_list, submit_uid)
    return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_ptr, part_list, modify_uid)
    return slurm.SUCCESS
end

slurm.log_info("job_submit.lua (placeholder) initialized")
return slurm.SUCCESS
