//! Declares a queue and prints every TimeoutMessage that arrives on it: body and headers.
//! Used by `scripts/demo.sh`; handy for watching a destination queue by hand.
//!
//! `cargo run --example consume -- QUEUE [AMQP_URI]`
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let queue = args.next().ok_or("usage: consume QUEUE [AMQP_URI]")?;
    let uri = args
        .next()
        .unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let conn = Connection::connect(&uri, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    eprintln!("consume: waiting for messages on queue {queue}");
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "timeoutd-demo".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery?;
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        let get = |k: &str| match headers.inner().get(k) {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            _ => String::new(),
        };
        println!(
            "received {} TimeoutId={} TimeSent={}",
            String::from_utf8_lossy(&delivery.data),
            get("TimeoutId"),
            get("TimeSent"),
        );
        delivery.ack(BasicAckOptions::default()).await?;
    }
    Ok(())
}
