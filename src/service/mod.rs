//! The process shell below the work: liveness and readiness (`health`), the supervision of
//! the essential tasks (`supervisor`), the HTTP endpoints (`http`), systemd notifications
//! (`systemd`) and signals (`shutdown`). It knows nothing of records, MongoDB or RabbitMQ:
//! the subsystems above report into it.

pub mod buildinfo;
pub mod health;
pub mod http;
pub mod progress;
pub mod shutdown;
pub mod supervisor;
pub mod systemd;
